"""Concurrent calls are shared fairly among tenants (weighted, a newcomer's room always
free, a reserved pool for the admin role), and idle client streams are cut, so that no
tenant's (nor two tenants') stalled streams can take the threads every other tenant and the
health checks need. A real shard on loopback; the hostile client is raw gRPC, no project
code."""

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
from tests.waiting import eventually

PUT = "/vericache.v1.PrefixStore/Put"
DESCRIBE = "/vericache.v1.PrefixStore/Describe"


def describe(address: str, token: str) -> grpc.StatusCode:
    """One raw Describe call's status."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(DESCRIBE, request_serializer=None, response_deserializer=None)
        try:
            call(b"", metadata=[("authorization", f"Bearer {token}")], timeout=10)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def settled(calls, held, count: int) -> None:
    """Wait until `count` of the calls are either refused (done) or held by the server
    (`held()`); fails after 10 s."""

    def settle() -> int:
        return sum(c.done() for c in calls) + held()

    assert eventually(lambda: settle() >= count), f"only {settle()} of {count} calls settled"


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
        settled(calls, lambda: server.servicer.limits.in_flight("hostile"), 64)
        refused = [c for c in calls if c.done()]
        assert len(refused) == 64 - 14  # alone: 28 less a newcomer's share; the rest hold
        for call in refused:
            assert call.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "fair share is 14 of 28" in call.exception().details()
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


def test_two_tenants_holding_all_they_can_leave_a_third_served(store, metadata):
    """Finding 4: two tenants each hold as many idle Put streams as the shard lets them;
    a third tenant's Describe calls all succeed, and so do health checks."""
    server = store.start("shard-0")
    release = threading.Event()
    opened = []
    try:
        for name in ("hog-a", "hog-b"):
            channel, calls = idle_puts(server.address, metadata.add_tenant(name), 64, release)
            opened.append((channel, calls))  # kept: a call collected is cancelled
            settled(calls, lambda n=name: server.servicer.limits.in_flight(n), 64)
            assert sum(c.done() for c in calls) < 64  # each holds some
        victim = metadata.add_tenant("victim")
        assert {describe(server.address, victim) for _ in range(100)} == {grpc.StatusCode.OK}
        with grpc.insecure_channel(server.address) as health:
            reply = health_pb2_grpc.HealthStub(health).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        for channel, _ in opened:
            channel.close()


def test_a_tenant_of_weight_two_gets_twice_the_slots(store, metadata):
    server = store.start("shard-0", workers=40, calls=CallBounds(per_tenant=30, total=30))
    tokens = {
        "heavy": metadata.add_tenant("heavy", weight=2.0),
        "light": metadata.add_tenant("light"),
    }
    release = threading.Event()
    channels = {n: grpc.insecure_channel(server.address) for n in tokens}
    held = server.servicer.limits.in_flight
    try:
        going, calls = set(tokens), []
        while going:  # both ask, one call at a time in turn, until both are refused
            for name in sorted(going):
                put = channels[name].stream_unary(PUT)
                before = held(name)
                call = put.future(
                    iter(lambda: release.wait(60) and None, None),
                    metadata=[("authorization", f"Bearer {tokens[name]}")],
                    timeout=60,
                )
                calls.append(call)  # kept: a call collected is cancelled
                settled([call], lambda n=name, b=before: held(n) - b, 1)
                if call.done():
                    assert "fair share" in call.exception().details()
                    going.discard(name)
        assert (held("heavy"), held("light")) == (15, 7)  # 30 * 2/4, 30 * 1/4
    finally:
        release.set()
        for channel in channels.values():
            channel.close()


def test_the_admin_role_is_served_from_its_reserved_slots(store, metadata):
    server = store.start("shard-0", calls=CallBounds(per_tenant=2, total=2, reserved=1))
    release = threading.Event()
    opened = []
    try:
        for name in ("a", "b"):  # each holds one of the two shared slots
            channel, calls = idle_puts(server.address, metadata.add_tenant(name), 1, release)
            opened.append((channel, calls))  # kept: a call collected is cancelled
            settled(calls, lambda n=name: server.servicer.limits.in_flight(n), 1)
        assert describe(server.address, metadata.add_tenant("c")) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        admin = metadata.add_tenant("operator", admin=True)
        assert {describe(server.address, admin) for _ in range(5)} == {grpc.StatusCode.OK}
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
        # the idle put holds the tenant's only slot
        assert eventually(lambda: server.servicer.limits.in_flight("patient") == 1)
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
