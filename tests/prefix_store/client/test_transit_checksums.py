"""End-to-end checksums: every fetched segment carries the CRC-32C stored with it since its
put, and the client checks it before the bytes are used. Bytes corrupted after the shard's
own checks (a flipped bit on the wire, injected by `prefix_store.faults`) are read from a
replica, or the prefix is a miss: never wrong bytes. Real shards on loopback, both
transports, both clients."""

from __future__ import annotations

import asyncio

import pytest
import torch

from prefix_store.client import AsyncStoreClient
from prefix_store.config import ClientConfig
from prefix_store.errors import NotFound
from prefix_store.faults import TRANSIT
from tests.prefix_store.client.test_client import empty
from tests.prefix_store.conftest import LAYOUT, random_kv

TOKENS = list(range(5000, 5000 + 16 * 6 + 3))


@pytest.fixture
def faults():
    yield TRANSIT
    TRANSIT.disarm()


def served(store) -> int:
    return sum(s.shard.stats.fetched_bytes for s in store.servers.values())


@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc"])
def test_a_segment_corrupted_in_transit_is_read_from_a_replica(store, metadata, faults, data_plane):
    store.start("shard-0")
    store.start("shard-1")
    token = metadata.add_tenant("alice")
    kv = random_kv(LAYOUT, len(TOKENS), seed=11)
    with store.client(token, data_plane=data_plane, streams=1) as client:
        prefix = client.publish_prefix(TOKENS, kv, LAYOUT).prefix
        before, fired = served(store), faults.fired
        faults.arm(1)
        k, v = empty(LAYOUT, prefix.tokens)
        client.fetch_layers(prefix, k, v)
        assert faults.fired == fired + 1
        assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])  # bitwise, no NaN left
        assert served(store) - before > LAYOUT.chunk_bytes(len(TOKENS))  # some read twice
        assert client.events() == {"failover.CorruptInTransit": 1}  # what the client met


@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc"])
def test_without_a_replica_corruption_in_transit_is_a_miss(store, metadata, faults, data_plane):
    store.start("shard-0")
    token = metadata.add_tenant("alice")
    kv = random_kv(LAYOUT, len(TOKENS), seed=12)
    with store.client(token, data_plane=data_plane) as client:
        prefix = client.publish_prefix(TOKENS, kv, LAYOUT).prefix
        faults.arm(1)
        k, v = empty(LAYOUT, prefix.tokens)
        with pytest.raises(NotFound, match="CRC-32C mismatch in transit"):
            client.fetch_layers(prefix, k, v)
        faults.disarm()
        client.fetch_layers(prefix, k, v)  # the stored bytes were never at fault
        assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])


def test_the_async_client_checks_segments_too(store, metadata, faults):
    store.start("shard-0")
    store.start("shard-1")
    token = metadata.add_tenant("alice")
    kv = random_kv(LAYOUT, len(TOKENS), seed=13)

    async def scenario():
        config = ClientConfig(timeout_s=10, stream_timeout_s=30, message_bytes=64 * 1024)
        async with await AsyncStoreClient.connect(store.endpoints, token, config) as client:
            prefix = (await client.publish_prefix(TOKENS, kv, LAYOUT)).prefix
            faults.arm(1)
            k, v = empty(LAYOUT, prefix.tokens)
            order = [layer async for layer in client.iter_layers(prefix, k, v)]
            return order, k, v, client.events()

    fired = faults.fired
    order, k, v, events = asyncio.run(scenario())
    assert faults.fired == fired + 1 and sorted(order) == list(range(LAYOUT.num_layers))
    assert events == {"failover.CorruptInTransit": 1}
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
