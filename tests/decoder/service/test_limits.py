"""The Decoder under hostile callers: concurrent calls bounded per tenant (over the limit:
RESOURCE_EXHAUSTED naming it, other tenants unaffected), and a reflection-driven sweep of
garbage and wild messages over every method that never ends UNKNOWN or INTERNAL and
leaves the decoder serving. Real store shard, Redis and the built-in model on loopback."""

from __future__ import annotations

import grpc
import pytest

from decoder.service.client import DecoderClient
from prefix_store.limits import CallBounds
from tests.decoder.service.test_auth import serve
from tests.hostile import sweep
from tests.prefix_store.conftest import Store


@pytest.fixture
def store(metadata, redis_server, tmp_path):
    store = Store(redis_server.url, tmp_path)
    store.start()
    yield store
    store.close()


def test_a_tenant_over_its_call_limit_is_told_so_and_others_are_served(
    store, metadata, builtin_model
):
    decoder = serve(store.endpoints, builtin_model, calls=CallBounds(per_tenant=1, total=2))
    busy, other = metadata.add_tenant("busy"), metadata.add_tenant("other")
    try:
        with DecoderClient(decoder.address, busy) as client:
            stream = client.stream(text="def fibonacci(n):", max_new_tokens=64)
            next(stream)  # the first call holds the tenant's only slot while it streams
            with pytest.raises(Exception) as refused:
                client.info()
            assert "per-tenant limit 1" in str(refused.value)
            with DecoderClient(decoder.address, other) as neighbour:
                assert neighbour.info().worker_id == decoder.config.worker_id
            stream.close()
    finally:
        decoder.stop(0)


def test_every_method_survives_hostile_input(store, metadata, builtin_model):
    decoder = serve(store.endpoints, builtin_model)
    token = metadata.add_tenant("hostile")
    try:
        assert sweep(decoder.address, "vericache.v1.Decoder", ["", "junk", token], count=4) == []
        with DecoderClient(decoder.address, token) as client:
            reply = client.generate(text="def add(a, b):", max_new_tokens=4)
            assert len(reply.tokens) == 4
        with grpc.insecure_channel(decoder.address) as channel:
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        decoder.stop(0)
