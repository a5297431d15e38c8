"""Concurrent calls are bounded per tenant and in all, and idle client streams are cut, so
that one tenant's stalled streams cannot take the threads every tenant and the health
checks need. A real shard on loopback; the hostile client is raw gRPC, no project code."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.limits import CallBounds
from prefix_store.status import BUSY_RETRY_MS, RETRY_AFTER
from tests.prefix_store.conftest import LAYOUT

PUT = "/vericache.v1.PrefixStore/Put"


def idle_puts(address: str, token: str, count: int, release: threading.Event):
    """`count` Put streams that authenticate, send nothing, and wait; returns their futures."""

    def nothing():
        release.wait(60)
        return
        yield  # a generator that sends no message

    channel = grpc.insecure_channel(address)
    put = channel.stream_unary(PUT, request_serializer=None, response_deserializer=None)
    auth = [("authorization", f"Bearer {token}")]
    calls = [put.future(nothing(), metadata=auth, timeout=60) for _ in range(count)]
    return channel, calls


def test_idle_streams_of_one_tenant_leave_room_for_others_and_health(store, metadata):
    server = store.start("shard-0")
    hostile, other = metadata.add_tenant("hostile"), metadata.add_tenant("other")
    release = threading.Event()
    channel, calls = idle_puts(server.address, hostile, 64, release)
    try:
        time.sleep(1.0)
        refused = [c for c in calls if c.done()]
        assert len(refused) == 64 - 16  # the per-tenant limit; the rest wait, holding slots
        for call in refused:
            assert call.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "per-tenant limit 16" in call.exception().details()
        with store.client(other) as client:
            start = time.monotonic()
            assert client.lookup(list(range(40)), LAYOUT).tokens == 0
            assert time.monotonic() - start < 5
        with grpc.insecure_channel(server.address) as health:
            reply = health_pb2_grpc.HealthStub(health).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        channel.close()


def test_the_server_wide_limit_names_itself(store, metadata):
    server = store.start("shard-0", calls=CallBounds(per_tenant=4, total=6))
    tokens = [metadata.add_tenant(f"t{i}") for i in range(3)]
    release = threading.Event()
    opened = [idle_puts(server.address, token, 3, release) for token in tokens]
    try:
        time.sleep(1.0)
        calls = [call for _, group in opened for call in group]
        refused = [c for c in calls if c.done()]
        assert len(refused) == 3
        assert all("server busy: 6 calls in flight" in c.exception().details() for c in refused)
    finally:
        release.set()
        for channel, _ in opened:
            channel.close()


def test_a_refusal_for_busy_is_marked_and_the_sdk_waits_it_out(store, metadata):
    server = store.start("shard-0", calls=CallBounds(per_tenant=1, total=4))
    token = metadata.add_tenant("patient")
    release = threading.Event()
    channel, (held,) = idle_puts(server.address, token, 1, release)
    try:
        time.sleep(0.5)  # the idle put holds the tenant's only slot
        _, (refused,) = idle_puts(server.address, token, 1, release)
        error = refused.exception(timeout=10)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (RETRY_AFTER, str(BUSY_RETRY_MS)) in error.trailing_metadata()
        # The SDK tries again (no quarantine: the shard is up) and is served once the slot
        # frees; a quota refusal (no RETRY_AFTER) would be raised at once.
        threading.Timer(1.0, release.set).start()
        start = time.monotonic()
        with store.client(token, retries=40, max_backoff_s=0.2) as client:  # Describe waits
            assert client.lookup(list(range(40)), LAYOUT).tokens == 0
            assert 0.8 < time.monotonic() - start < 10 and not client.suspects()
    finally:
        release.set()
        channel.close()


def test_a_stream_that_goes_quiet_is_cut(store, metadata):
    server = store.start("shard-0", calls=CallBounds(stream_idle_s=1.0))
    token = metadata.add_tenant("quiet")
    header = pb.PutHeader(layout=LAYOUT.to_proto(pb), token_ids=list(range(16)), chunk_indices=[0])
    release = threading.Event()

    def header_then_silence():
        yield pb.PutRequest(header=header).SerializeToString()
        release.wait(60)

    with grpc.insecure_channel(server.address) as channel:
        put = channel.stream_unary(PUT, request_serializer=None, response_deserializer=None)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as failure:
            put(header_then_silence(), metadata=[("authorization", f"Bearer {token}")], timeout=30)
        release.set()
    assert failure.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED)
    assert time.monotonic() - start < 10
    with store.client(token) as client:  # nothing of it was stored; the tenant can go on
        assert client.lookup(list(range(16)), LAYOUT).tokens == 0
