"""The store client contract, run on both clients: every failover scenario against real
shards on loopback, through one adapter (`StoreClient` called directly, `AsyncStoreClient`
on an event loop of its own). Both are shells over `client.core`, so each scenario must
end the same on both: the same bytes, the same error types and messages."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from prefix_store.client import AsyncStoreClient, StoreClient
from prefix_store.client import plan as client_plan
from prefix_store.config import ClientConfig
from prefix_store.errors import Unavailable
from prefix_store.faults import TRANSIT
from prefix_store.layout import KVLayout
from tests.prefix_store.client.test_client import empty
from tests.prefix_store.conftest import LAYOUT, random_kv

TOKENS = list(range(7000, 7000 + 16 * 6 + 5))
WIDE = KVLayout(
    "test-model@1", "float32", num_layers=8, num_kv_heads=4, head_dim=64, chunk_tokens=256
)  # 512 KiB per chunk and layer, 16 chunks at 4096 tokens
DISK = 64 << 20


class AsyncAdapter:
    """An `AsyncStoreClient` called like a `StoreClient`, on a loop of its own."""

    def __init__(self, endpoints, token: str, config: ClientConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.client = self.loop.run_until_complete(
            AsyncStoreClient.connect(endpoints, token, config)
        )

    def __getattr__(self, name: str):
        attr = getattr(self.client, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr
        return lambda *args, **kwargs: self.loop.run_until_complete(attr(*args, **kwargs))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


@pytest.fixture(params=["sync", "async"])
def connect(request, store):
    """connect(token, **config): a client of the parametrized kind, closed after the test."""
    opened = []

    def open_client(token: str, **overrides):
        overrides = {"timeout_s": 10.0, "stream_timeout_s": 30.0, "retries": 2, **overrides}
        config = ClientConfig(**overrides)
        if request.param == "sync":
            client = StoreClient(store.endpoints, token, config)
        else:
            client = AsyncAdapter(store.endpoints, token, config)
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        client.close()


@pytest.fixture
def faults():
    yield TRANSIT
    TRANSIT.disarm()


def fetched(store, shard_id: str) -> int:
    return store.servers[shard_id].shard.stats.fetched_bytes


def chunks_on(store, shard_id: str) -> int:
    return store.servers[shard_id].shard.counts()["chunks"]


def fetch_bitwise(client, prefix, kv) -> None:
    k, v = empty(prefix.layout, prefix.tokens)
    client.fetch_layers(prefix, k, v)
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])


def restart(store, shard_id: str, **overrides) -> None:
    """Stop a shard gracefully (its memory tier goes to disk) and start it again."""
    store.stop(shard_id)
    store.start(shard_id, disk_bytes=DISK, **overrides)


def client_owning(metadata, connect, layout, tokens, shard_id, chunks, **config):
    """A client whose tenant's salt makes `shard_id` the first owner of at least `chunks`
    chunks of `tokens` (placement hashes the salted keys, so the split varies by tenant)."""
    for i in range(20):
        client = connect(metadata.add_tenant(f"tenant-{i}"), **config)
        plan = client_plan.plan_chunks(tokens, layout, client.topology.salt(""))
        firsts = [client.topology.owners(c.parent)[0] for c in plan]
        if firsts.count(shard_id) >= chunks and len(set(firsts)) > 1:
            return client
    raise AssertionError(f"no tenant salt puts {chunks} chunks first on {shard_id}")


def test_a_shard_lost_mid_fetch_is_replaced_by_a_replica_bitwise(
    store, metadata, connect, monkeypatch
):
    store.start("shard-0")
    store.start("shard-1")
    tokens = list(range(4096))
    # shard-0 then has more to send after layer 0 than the sockets hold (2 x 8 MiB)
    config = dict(streams=1, window_bytes=1 << 20)
    client = client_owning(metadata, connect, WIDE, tokens, "shard-0", 6, **config)
    kv = random_kv(WIDE, len(tokens), seed=21)
    prefix = client.publish_prefix(tokens, kv, WIDE).prefix
    mark = client_plan.Assembly.mark_layer
    first = {c.index: client.topology.owners(c.parent)[0] for c in prefix.chunks}

    def crash_after_first_layer(self, chunks, layer, nbytes):
        mark(self, chunks, layer, nbytes)
        if first[chunks[0].index] == "shard-0" and "shard-0" in store.servers:
            store.stop("shard-0", 0)  # no grace; its stream is held here meanwhile

    monkeypatch.setattr(client_plan.Assembly, "mark_layer", crash_after_first_layer)
    fetch_bitwise(client, prefix, kv)
    share = [c for c in prefix.chunks if first[c.index] == "shard-1"]
    assert fetched(store, "shard-1") > sum(WIDE.chunk_bytes(c.tokens) for c in share)


def test_with_no_replica_left_a_fetch_fails_the_same_clear_way(store, metadata, connect):
    store.start("shard-0")
    client = connect(metadata.add_tenant("alice"))
    prefix = client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT).prefix
    store.stop("shard-0", 0)
    k, v = empty(LAYOUT, prefix.tokens)
    with pytest.raises(
        Unavailable, match=r"^fetch: chunk \d+: no live shard holds it \(tried shard-0\): "
    ):
        client.fetch_layers(prefix, k, v)


def test_a_segment_corrupted_in_transit_is_read_from_a_replica(store, metadata, connect, faults):
    store.start("shard-0")
    store.start("shard-1")
    client = connect(metadata.add_tenant("alice"), streams=1)
    kv = random_kv(LAYOUT, len(TOKENS), seed=22)
    prefix = client.publish_prefix(TOKENS, kv, LAYOUT).prefix
    fired = faults.fired
    faults.arm(1)
    fetch_bitwise(client, prefix, kv)
    assert faults.fired == fired + 1
    assert client.suspects() == frozenset()  # corruption is not an unreachable shard


def test_a_shard_restarted_on_a_new_address_is_used_after_a_refresh(store, metadata, connect):
    store.start("shard-0", disk_bytes=DISK)
    store.start("shard-1", disk_bytes=DISK)
    config = dict(refresh_s=60, min_refresh_s=0.05)
    client = client_owning(metadata, connect, LAYOUT, TOKENS, "shard-1", 1, **config)
    kv = random_kv(LAYOUT, len(TOKENS), seed=23)
    prefix = client.publish_prefix(TOKENS, kv, LAYOUT).prefix
    old = client.topology.shards["shard-1"]
    restart(store, "shard-1")
    assert store.servers["shard-1"].address != old
    fetch_bitwise(client, prefix, kv)  # the old address fails: replica, refresh due
    assert client.suspects() == {"shard-1"}
    time.sleep(0.1)
    fetch_bitwise(client, prefix, kv)  # refreshed first: the new address, no quarantine
    assert client.topology.shards["shard-1"] == store.servers["shard-1"].address
    assert client.suspects() == frozenset()
    assert fetched(store, "shard-1") > 0


def test_a_shard_that_joins_later_is_admitted_once_stable(store, metadata, connect):
    store.start("shard-0")
    client = connect(metadata.add_tenant("alice"), refresh_s=0.1, membership_grace_s=0.5)
    store.start("shard-1")
    time.sleep(0.2)
    client.stats()  # a refresh that lists shard-1: pending, not placed on yet
    assert set(client.topology.shards) == {"shard-0"}
    deadline = time.monotonic() + 10
    while "shard-1" not in client.topology.shards and time.monotonic() < deadline:
        time.sleep(0.1)
        client.stats()
    assert set(client.topology.shards) == {"shard-0", "shard-1"}
    assert client.topology.replication == 2
    kv = random_kv(LAYOUT, len(TOKENS), seed=24)
    assert client.publish_prefix(TOKENS, kv, LAYOUT).missing_replicas == 0
    assert chunks_on(store, "shard-1") == chunks_on(store, "shard-0") > 0


def test_a_shard_that_vanishes_briefly_keeps_its_placement(store, metadata, connect):
    store.start("shard-0", disk_bytes=DISK)
    store.start("shard-1", disk_bytes=DISK)
    config = dict(refresh_s=0.1, membership_grace_s=60)
    client = client_owning(metadata, connect, LAYOUT, TOKENS, "shard-1", 1, **config)
    kv = random_kv(LAYOUT, len(TOKENS), seed=25)
    prefix = client.publish_prefix(TOKENS, kv, LAYOUT).prefix
    store.stop("shard-1")
    time.sleep(0.2)
    assert client.lookup(TOKENS, LAYOUT).tokens == prefix.tokens  # refreshed: shard-1 absent
    assert client.topology.absent == {"shard-1"}
    assert (
        set(client.topology.shards) == {"shard-0", "shard-1"} and client.topology.replication == 2
    )
    other = [t + 1 for t in TOKENS]
    result = client.publish_prefix(other, kv, LAYOUT)
    assert result.missing_replicas == len(result.prefix.chunks)  # not re-placed elsewhere
    store.start("shard-1", disk_bytes=DISK)
    time.sleep(0.2)
    fetch_bitwise(client, prefix, kv)
    assert client.topology.absent == frozenset()
    assert fetched(store, "shard-1") > 0  # back at its new address, with its chunks


def test_a_failed_shard_is_quarantined_until_its_quarantine_expires(store, metadata, connect):
    store.start("shard-0", disk_bytes=DISK)
    store.start("shard-1", disk_bytes=DISK)
    config = dict(quarantine_s=1.0, refresh_s=60, min_refresh_s=0.05)
    client = client_owning(metadata, connect, LAYOUT, TOKENS, "shard-1", 1, **config)
    kv = random_kv(LAYOUT, len(TOKENS), seed=26)
    prefix = client.publish_prefix(TOKENS, kv, LAYOUT).prefix
    port = int(client.topology.shards["shard-1"].rpartition(":")[2])
    store.stop("shard-1")
    fetch_bitwise(client, prefix, kv)
    assert client.suspects() == {"shard-1"}
    store.start("shard-1", disk_bytes=DISK, port=port)  # the same address: still suspect
    time.sleep(0.1)
    fetch_bitwise(client, prefix, kv)  # refreshed (new data address), shard-1 not tried
    assert fetched(store, "shard-1") == 0
    assert client.lookup(TOKENS, LAYOUT).tokens == prefix.tokens
    assert store.servers["shard-1"].shard.stats.hits == 0  # lookups avoid it too
    time.sleep(1.0)
    assert client.suspects() == frozenset()
    fetch_bitwise(client, prefix, kv)
    assert fetched(store, "shard-1") > 0


def test_a_publish_with_a_shard_down_reports_missing_replicas(store, metadata, connect):
    store.start("shard-0")
    store.start("shard-1")
    client = connect(metadata.add_tenant("alice"), refresh_s=60)
    store.stop("shard-1", 0)
    kv = random_kv(LAYOUT, len(TOKENS), seed=27)
    result = client.publish_prefix(TOKENS, kv, LAYOUT)
    assert result.missing_replicas == len(result.prefix.chunks)
    assert chunks_on(store, "shard-0") == len(result.prefix.chunks)
    assert client.suspects() == {"shard-1"}
    fetch_bitwise(client, result.prefix, kv)


def test_a_publish_that_leaves_a_chunk_without_a_copy_is_undone(store, metadata, connect):
    metadata.set_replication(1)
    store.start("shard-0")
    store.start("shard-1")
    client = client_owning(metadata, connect, LAYOUT, TOKENS, "shard-1", 1, refresh_s=60)
    assert client.topology.replication == 1
    store.stop("shard-1", 0)
    with pytest.raises(Unavailable, match="shard"):
        client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS), seed=28), LAYOUT)
    assert chunks_on(store, "shard-0") == 0  # what shard-0 stored was deleted again
