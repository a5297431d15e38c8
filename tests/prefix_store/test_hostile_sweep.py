"""A hostile-input sweep over every PrefixStore method, driven by the server's reflection
(no project code in the client): garbage bytes and well-formed messages with wild values,
with no token, a junk token and a valid one. No call may end UNKNOWN or INTERNAL; the
shard stays healthy and what was stored before is intact."""

from __future__ import annotations

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.hostile import sweep
from tests.prefix_store.conftest import LAYOUT, random_kv

TOKENS = list(range(900, 950))


def test_every_method_survives_hostile_input(store, metadata):
    for shard_id in ("shard-0", "shard-1"):
        store.start(shard_id)
    token = metadata.add_tenant("victim", 1 << 30)
    hostile = metadata.add_tenant("hostile", 1 << 20)
    metadata.add_shared("docs", ["victim", "hostile"])
    kv = random_kv(LAYOUT, len(TOKENS))
    with store.client(token) as client:
        client.publish_prefix(TOKENS, kv, LAYOUT, namespace="docs")
    broken = sweep(store.endpoints[0], "vericache.v1.PrefixStore", ["", "junk", hostile])
    assert broken == []
    with grpc.insecure_channel(store.endpoints[0]) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with store.client(token) as client:
        prefix = client.lookup(TOKENS, LAYOUT, "docs")
        assert prefix.tokens == len(TOKENS)
        k = torch.empty(LAYOUT.num_layers, LAYOUT.num_kv_heads, prefix.tokens, LAYOUT.head_dim)
        v = torch.empty_like(k)
        client.fetch_layers(prefix, k, v)
        assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
