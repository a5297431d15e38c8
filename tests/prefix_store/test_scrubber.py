"""The scrubber finds corrupt blobs at rest, in memory and on disk, before any read does:
it drops them as a corrupt read would (a later lookup is a miss, replicas take over),
counts them (shard stats, Prometheus), and leaves intact blobs and their recency alone."""

from __future__ import annotations

import time

import pytest

from prefix_store.scrub import Scrubber
from tests.prefix_store.conftest import LAYOUT
from tests.prefix_store.test_shard import CHUNK, SPACE, make, put

A, B, C = (list(range(first, first + 16)) for first in (0, 100, 200))


def cached(shard, tokens) -> int:
    return shard.lookup(SPACE, LAYOUT, tokens).cached_tokens


def corrupt_in_memory(shard, tokens) -> None:
    blob = shard.memory.peek(("chunk", SPACE.id, put_keys[tuple(tokens)]))
    segment = blob.data[1]
    segment[5] ^= 0xFF  # a bit flip in host memory, after the put was checked


def corrupt_on_disk(shard, tokens) -> None:
    blob_id = ("chunk", SPACE.id, put_keys[tuple(tokens)])
    entry = shard.disk._index[blob_id]
    with open(entry.path, "r+b") as f:
        f.seek(entry.offset + 3 * entry.blob.segment_bytes)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


put_keys: dict[tuple, int] = {}


def store(shard, tokens) -> None:
    (keys, _), _ = put(shard, tokens)
    put_keys[tuple(tokens)] = keys[0]


def test_a_scrub_pass_drops_corrupt_blobs_in_both_tiers_and_counts_them(tmp_path):
    shard = make(tmp_path, memory_chunks=2, disk_chunks=4)
    for tokens in (A, B, C):  # A spills to disk when C arrives
        store(shard, tokens)
    assert ("chunk", SPACE.id, put_keys[tuple(A)]) in shard.disk
    corrupt_on_disk(shard, A)
    corrupt_in_memory(shard, C)
    checked = Scrubber(shard, rate=1 << 30).scrub_pass()
    assert checked == 3 * CHUNK
    assert (shard.stats.scrub_corrupt, shard.stats.corrupt) == (2, 2)
    assert shard.stats.scrubbed_bytes == 3 * CHUNK
    assert (cached(shard, A), cached(shard, B), cached(shard, C)) == (0, 16, 0)
    assert shard.accounting() == (CHUNK, CHUNK)  # only B left, and charged


def test_the_shards_scrubber_runs_in_the_background_and_is_reported(store, metadata):
    from tests.prefix_store.conftest import random_kv

    server = store.start(scrub_rate=1 << 30)
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        client.publish_prefix(A, random_kv(LAYOUT, 16), LAYOUT)
        blob_id = next(i for i in server.shard.scrub_ids() if i[0] == "chunk")
        server.shard.memory.peek(blob_id).data[0][0] ^= 0xFF
        deadline = time.monotonic() + 10
        while server.servicer.shard_stats()["scrub_corrupt"] < 1:
            assert time.monotonic() < deadline, "the scrubber did not find the corrupt chunk"
            time.sleep(0.05)
        assert client.lookup(A, LAYOUT).tokens == 0  # never served: a miss now
    from prometheus_client import generate_latest

    text = generate_latest(server.servicer.metrics.registry).decode()
    assert "vericache_store_scrub_corrupt_total 1.0" in text


def test_a_scrubber_needs_a_positive_rate(tmp_path):
    with pytest.raises(ValueError, match="rate"):
        Scrubber(make(tmp_path), rate=0)
