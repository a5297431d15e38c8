"""The client SDKs against real shards: placement and replication over several shards,
layer streaming, failover to a replica mid-stream, and the asyncio client."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from prefix_store.client import AsyncStoreClient, StoreClient, rendezvous
from prefix_store.client.link import BULK_BYTES, LinkMeter
from prefix_store.config import ClientConfig
from prefix_store.errors import InvalidArgument, NotFound
from prefix_store.layout import KVLayout
from tests.prefix_store.conftest import LAYOUT, random_kv
from tests.waiting import eventually

BIG = KVLayout(
    "test-model@1", "float32", num_layers=8, num_kv_heads=4, head_dim=64, chunk_tokens=256
)  # 2 MiB per chunk, 8 MiB per layer at 4096 tokens


def empty(layout, tokens, layers=None):
    shape = (layers or layout.num_layers, layout.num_kv_heads, tokens, layout.head_dim)
    return torch.full(shape, float("nan")), torch.full(shape, float("nan"))


def test_rendezvous_moves_only_the_keys_of_a_removed_shard():
    shards = [f"shard-{i}" for i in range(4)]
    keys = range(0, 2**64, 2**64 // 500)
    before = {k: rendezvous(k, shards, 2) for k in keys}
    after = {k: rendezvous(k, shards[:3], 2) for k in keys}
    for k in keys:
        if "shard-3" not in before[k]:
            assert after[k] == before[k]
        else:
            assert before[k][0] in after[k] or before[k][1] in after[k]
    primaries = [before[k][0] for k in keys]
    assert all(primaries.count(s) > 60 for s in shards)  # spread over all shards


def test_chunks_spread_over_shards_with_two_replicas_and_fetch_bitwise(store, metadata):
    for i in range(3):
        store.start(f"shard-{i}")
    token = metadata.add_tenant("alice")
    tokens = list(range(1000, 1000 + 16 * 12 + 5))
    kv = random_kv(LAYOUT, len(tokens), seed=3)
    with store.client(token) as client:
        assert client.topology.replication == 2
        result = client.publish_prefix(tokens, kv, LAYOUT)
        assert result.missing_replicas == 0
        assert result.stored_bytes == 2 * LAYOUT.chunk_bytes(len(tokens))
        per_shard = [s.chunks for s in client.stats()]
        assert sum(per_shard) == 2 * 13 and min(per_shard) > 0
        prefix = client.lookup(tokens, LAYOUT)
        assert prefix.tokens == len(tokens)
        k, v = empty(LAYOUT, prefix.tokens, layers=2)
        client.fetch_layers(prefix, k, v, layer_start=1, layer_end=3)
        assert torch.equal(k, kv[1:3, 0]) and torch.equal(v, kv[1:3, 1])


def test_bulk_reads_record_the_link_rate_in_a_shared_meter(store, metadata):
    """Clients given one `LinkMeter` (a decoder's, whatever the tenant) record the rate of
    their bulk reads in it, and their Describes' round trips; a read of a few hundred KB (one
    round trip) is not a rate."""
    store.start("shard-0")
    meter = LinkMeter()
    tokens = list(range(5000, 5000 + 256 + 3))  # 0.5 MiB per layer
    kv = random_kv(BIG, len(tokens), seed=5)
    alice, bob = metadata.add_tenant("alice"), metadata.add_tenant("bob")
    with store.client(alice) as writer:
        writer.publish_prefix(tokens, kv, BIG)
    reader = StoreClient(store.endpoints, bob, ClientConfig(timeout_s=10.0), link=meter)
    assert 0 < meter.round_trip_s < 10.0  # its Describe
    with reader, StoreClient(store.endpoints, alice, ClientConfig(), link=meter) as other:
        prefix = other.lookup(tokens, BIG)
        k, v = empty(BIG, prefix.tokens, layers=1)
        assert other.fetch_layers(prefix, k, v, 0, 1) < BULK_BYTES and meter.bandwidth == 0
        k, v = empty(BIG, prefix.tokens)
        nbytes = other.fetch_layers(prefix, k, v)
        assert nbytes == BIG.chunk_bytes(prefix.tokens) and torch.equal(k, kv[:, 0])
        assert reader.link is other.link and meter.bandwidth > 0


def test_iter_layers_yields_layers_in_order_as_they_complete(store, metadata):
    store.start()
    token = metadata.add_tenant("alice")
    tokens = list(range(300))
    kv = random_kv(LAYOUT, 300, seed=4)
    with store.client(token, message_bytes=64 * 1024) as client:
        prefix = client.publish_prefix(tokens, kv, LAYOUT).prefix
        k, v = empty(LAYOUT, 300)
        seen = []
        for layer in client.iter_layers(prefix, k, v):
            assert torch.equal(k[layer], kv[layer, 0])  # complete when yielded
            seen.append(layer)
        assert seen == list(range(LAYOUT.num_layers))


def test_nothing_is_written_into_the_outputs_after_the_consumer_stops(store, metadata):
    store.start()
    token = metadata.add_tenant("alice")
    tokens = list(range(4096))
    kv = random_kv(BIG, 4096, seed=8)
    with store.client(token, window_bytes=1 << 20, streams=2) as client:
        prefix = client.publish_prefix(tokens, kv, BIG).prefix
        k, v = empty(BIG, 4096)
        layers = client.iter_layers(prefix, k, v)
        assert next(layers) == 0
        layers.close()  # stops the streams and waits for them
        snapshot = k.clone()
        time.sleep(0.5)
        assert torch.equal(k.nan_to_num(7.0), snapshot.nan_to_num(7.0))
        assert torch.isnan(k[-1]).any()  # the last layer never arrived


def test_a_shard_lost_mid_fetch_is_replaced_by_a_replica_bitwise(store, metadata):
    store.start("shard-0")
    store.start("shard-1")
    token = metadata.add_tenant("alice")
    tokens = list(range(4096))
    kv = random_kv(BIG, 4096, seed=5)
    config = dict(message_bytes=256 * 1024, window_bytes=1 << 20, streams=1)
    with store.client(token, **config) as client:
        prefix = client.publish_prefix(tokens, kv, BIG).prefix
        k, v = empty(BIG, 4096)
        layers = client.iter_layers(prefix, k, v)
        assert next(layers) == 0
        threading.Thread(target=store.stop, args=("shard-0", 0)).start()  # crash: no grace
        assert list(layers) == list(range(1, BIG.num_layers))
        assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
        served = store.servers["shard-1"].shard.stats.fetched_bytes
        assert served > BIG.chunk_bytes(4096) // 2  # the survivor served its share and more


def test_with_no_replica_left_a_fetch_fails_clearly(store, metadata):
    store.start("shard-0")
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix = client.publish_prefix(list(range(40)), random_kv(LAYOUT, 40), LAYOUT).prefix
        store.stop("shard-0", 0)
        k, v = empty(LAYOUT, 40)
        with pytest.raises(Exception, match="unavailable|no live shard|tried"):
            client.fetch_layers(prefix, k, v)


def test_chunks_their_best_owner_lost_are_found_on_a_replica(store, metadata, tmp_path):
    """A shard back with an empty disk (its host replaced) is the best owner of some chunks:
    the lookup asks their other owner, finds the whole prefix (sync and asyncio clients),
    the fetch reads it bitwise, and a cold miss still answers 0."""
    store.start("shard-0")
    store.start("shard-1")
    token = metadata.add_tenant("alice")
    tokens = list(range(3000, 3000 + 16 * 12 + 5))
    kv = random_kv(LAYOUT, len(tokens), seed=7)
    with store.client(token) as client:
        published = client.publish_prefix(tokens, kv, LAYOUT).prefix
    store.stop("shard-0")
    store.start("shard-0", disk_dir=tmp_path / "new-disk")
    with store.client(token) as client:
        assert eventually(lambda: len(client.stats()) == 2)
        owners = [client.topology.owners(c.parent)[0] for c in published.chunks]
        assert "shard-0" in owners[: len(owners) // 2]  # it leads the lookup of some chunks
        assert [s.chunks for s in client.stats()] == [0, len(published.chunks)]
        prefix = client.lookup(tokens, LAYOUT)
        assert prefix.tokens == len(tokens) and prefix.key == published.key
        k, v = empty(LAYOUT, prefix.tokens)
        client.fetch_layers(prefix, k, v)
        assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
        assert client.lookup(list(range(50, 90)), LAYOUT).tokens == 0

    async def asynchronously():
        async with await AsyncStoreClient.connect(store.endpoints, token) as client:
            return await client.lookup(tokens, LAYOUT)

    assert asyncio.run(asynchronously()).tokens == len(tokens)


def test_bad_outputs_and_inputs_are_invalid_arguments(store, metadata):
    store.start()
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix = client.publish_prefix(list(range(40)), random_kv(LAYOUT, 40), LAYOUT).prefix
        with pytest.raises(InvalidArgument, match="k_out"):
            client.fetch_layers(prefix, torch.empty(4, 2, 10, 8), torch.empty(4, 2, 10, 8))
        with pytest.raises(InvalidArgument, match="kv"):
            client.publish_prefix(list(range(40)), random_kv(LAYOUT, 30), LAYOUT)
        with pytest.raises(InvalidArgument, match="dtype"):
            client.publish_prefix(list(range(40)), random_kv(LAYOUT, 40).half(), LAYOUT)
        with pytest.raises(InvalidArgument, match="token ids"):
            client.lookup([-1, 5], LAYOUT)
        with pytest.raises(NotFound, match="namespace 'nope'"):
            client.lookup([1, 2], LAYOUT, namespace="nope")


def test_async_client_publishes_looks_up_and_streams(store, metadata):
    store.start("shard-0")
    store.start("shard-1")
    token = metadata.add_tenant("alice")
    tokens = list(range(2000, 2000 + 16 * 5 + 3))
    kv = random_kv(LAYOUT, len(tokens), seed=6)

    async def scenario():
        config = ClientConfig(timeout_s=10, stream_timeout_s=30, message_bytes=64 * 1024)
        async with await AsyncStoreClient.connect(store.endpoints, token, config) as client:
            published = await client.publish_prefix(tokens, kv, LAYOUT)
            prefix = await client.lookup(tokens + [7], LAYOUT)
            assert prefix.tokens == len(tokens) and prefix.key == published.prefix.key
            k, v = empty(LAYOUT, prefix.tokens)
            order = [layer async for layer in client.iter_layers(prefix, k, v)]
            assert order == list(range(LAYOUT.num_layers))
            assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
            await client.put_artifact(prefix, "kivi:bits=4", b"q" * 1000)
            assert await client.fetch_artifact(prefix, "kivi:bits=4") == b"q" * 1000
            assert len(await client.stats()) == 2

    asyncio.run(scenario())
