"""The shard and its tiers: LRU eviction and spilling, leases, the disk tier across a
restart, checksums, partial chunks, two-phase puts. Real files, no servers."""

from __future__ import annotations

import pytest

from prefix_store.blob import combined_crc, crc32c
from prefix_store.config import ShardConfig
from prefix_store.errors import (
    DataLoss,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
    StoreFull,
    Unavailable,
)
from prefix_store.namespace import Namespace
from prefix_store.shard import Allowance, ChunkRef, Deletable, Shard
from tests.prefix_store.conftest import LAYOUT

SPACE = Namespace("tenant:a", "", b"salt-a")
CHUNK = LAYOUT.chunk_bytes(LAYOUT.chunk_tokens)  # 8 KiB per 16-token chunk here


def no_quota(owner):
    return None  # unlimited


def put(shard, tokens, seed=0, indices=None, space=SPACE, quota=no_quota):
    """A complete two-phase put; returns (keys, new bytes) and the segments it sent."""
    n_chunks = -(-len(tokens) // LAYOUT.chunk_tokens)
    indices = list(range(n_chunks)) if indices is None else indices
    session = shard.begin_put(space, LAYOUT, tokens, indices, "a", quota)
    sent = {}
    for j, index in enumerate(indices):
        size = LAYOUT.segment_bytes(min(LAYOUT.chunk_tokens, len(tokens) - index * 16))
        for layer in range(LAYOUT.num_layers):
            data = bytes([(seed + index * 7 + layer) % 256]) * size
            session.add(layer, j, data)
            sent[(index, layer)] = data
    crcs = [combined_crc(sent[(i, lyr)] for lyr in range(LAYOUT.num_layers)) for i in indices]
    done = session.commit(crcs)
    return (done.keys, done.new_bytes), sent


def fetch_all(shard, result_keys, tokens_per_chunk, space=SPACE):
    refs = [ChunkRef(k, n) for k, n in zip(result_keys, tokens_per_chunk, strict=True)]
    out = {}
    for batch in shard.fetch(space, LAYOUT, refs, 0, LAYOUT.num_layers, 64 * 1024):
        for layer, index, data, crc in batch:
            assert crc32c(data) == crc  # the stored checksum travels with the bytes
            out[(index, layer)] = data
    return out


def make(tmp_path, memory_chunks=8, disk_chunks=0, name="s"):
    return Shard(
        ShardConfig(
            shard_id=name,
            memory_bytes=memory_chunks * CHUNK,
            disk_bytes=disk_chunks * CHUNK,
            disk_dir=tmp_path / name,
        )
    )


def test_put_then_lookup_and_fetch_layer_major(tmp_path):
    shard = make(tmp_path)
    tokens = list(range(40))  # 16 + 16 + 8
    (keys, new), sent = put(shard, tokens)
    assert new == LAYOUT.chunk_bytes(16) * 2 + LAYOUT.chunk_bytes(8)
    found = shard.lookup(SPACE, LAYOUT, tokens)
    assert found.present == [0, 1] and (found.partial_index, found.partial_tokens) == (2, 8)
    assert found.cached_tokens == 40
    order = []
    refs = [ChunkRef(k, n) for k, n in zip(keys, (16, 16, 8), strict=True)]
    for batch in shard.fetch(SPACE, LAYOUT, refs, 1, 3, 64 * 1024):
        order += [(layer, index) for layer, index, _, _ in batch]
        for layer, index, data, _ in batch:
            assert data == sent[(index, layer)]
    assert order == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]  # one layer, then next


def test_a_hit_is_confirmed_by_tokens_and_a_longer_prompt_finds_the_partial_chunk(tmp_path):
    shard = make(tmp_path)
    put(shard, list(range(40)))
    longer = list(range(40)) + [999, 998, 997]
    found = shard.lookup(SPACE, LAYOUT, longer)
    assert found.present == [0, 1]
    assert (found.partial_index, found.partial_tokens) == (2, 8)
    assert found.cached_tokens == 40
    diverging = list(range(20)) + [5] * 20
    assert shard.lookup(SPACE, LAYOUT, diverging).cached_tokens == 16
    other = Namespace("tenant:b", "", b"salt-b")
    assert shard.lookup(other, LAYOUT, longer).cached_tokens == 0


def test_lru_eviction_spills_to_disk_and_drops_from_disk_last_used_first(tmp_path):
    shard = make(tmp_path, memory_chunks=2, disk_chunks=2)
    prompts = [[p * 100 + i for i in range(16)] for p in range(5)]
    for p in prompts[:3]:
        put(shard, p)
    # Memory holds 2: the first prompt's chunk was spilled to disk.
    assert shard.memory.used == 2 * CHUNK and shard.disk.used == CHUNK
    shard.lookup(SPACE, LAYOUT, prompts[0])  # touching does not reorder tiers across each other
    put(shard, prompts[3])  # spills prompt 1 to disk
    put(shard, prompts[4])  # spills prompt 2; disk over capacity drops its LRU (prompt 0)
    cached = [shard.lookup(SPACE, LAYOUT, p).cached_tokens for p in prompts]
    assert cached == [0, 16, 16, 16, 16]
    assert shard.stats.evictions == 3
    assert shard.usage() == {"a": 4 * CHUNK}


def test_a_lease_pins_chunks_against_eviction(tmp_path):
    shard = make(tmp_path, memory_chunks=2, disk_chunks=0)
    first, other = list(range(16)), list(range(100, 116))
    (keys, _), _ = put(shard, first)
    put(shard, other)
    shard.lookup(SPACE, LAYOUT, other)
    stream = shard.fetch(SPACE, LAYOUT, [ChunkRef(keys[0], 16)], 0, 4, 64 * 1024)
    next(stream)  # a fetch of `first` is in progress: it is leased
    put(shard, list(range(200, 216)))  # evicts `other` although `first` is older
    assert shard.lookup(SPACE, LAYOUT, first).cached_tokens == 16
    assert shard.lookup(SPACE, LAYOUT, other).cached_tokens == 0
    key = shard.lookup(SPACE, LAYOUT, list(range(200, 216))).keys[0]
    second = shard.fetch(SPACE, LAYOUT, [ChunkRef(key, 16)], 0, 4, 64 * 1024)
    next(second)  # now everything resident is leased: a new chunk finds no room
    with pytest.raises(StoreFull, match="no room"):
        put(shard, list(range(300, 316)))
    assert shard.usage() == {"a": 2 * CHUNK}
    list(stream)  # the first fetch ends and releases its lease
    second.close()
    put(shard, list(range(300, 316)))
    assert shard.counts()["leased"] == 0


def test_disk_tier_survives_a_restart(tmp_path):
    shard = make(tmp_path, memory_chunks=4, disk_chunks=8)
    tokens = list(range(40))
    (keys, _), sent = put(shard, tokens)
    assert shard.flush() == 3
    again = make(tmp_path, memory_chunks=4, disk_chunks=8)
    assert again.lookup(SPACE, LAYOUT, tokens).cached_tokens == 40
    assert fetch_all(again, keys, (16, 16, 8)) == sent
    assert again.usage() == {"a": shard.usage()["a"]}


def test_corrupted_bytes_are_detected_on_read_dropped_and_then_a_miss(tmp_path):
    shard = make(tmp_path, memory_chunks=1, disk_chunks=4)
    first, second = list(range(16)), list(range(50, 66))
    (keys, _), _ = put(shard, first)
    put(shard, second)  # spills `first` to disk
    path = next(p for p in (tmp_path / "s").glob("*.blob"))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # flip bits in the last layer of the stored data
    path.write_bytes(bytes(raw))
    with pytest.raises(DataLoss, match="checksum"):
        fetch_all(shard, keys, (16,))
    assert shard.lookup(SPACE, LAYOUT, first).cached_tokens == 0
    assert not list((tmp_path / "s").glob("*.blob"))
    # In memory too: a flipped bit in a resident segment is caught the same way.
    key2 = shard.lookup(SPACE, LAYOUT, second).keys[0]
    blob = shard.memory.get(("chunk", SPACE.id, key2))
    blob.data = (bytes([blob.data[0][0] ^ 0xFF]) + blob.data[0][1:], *blob.data[1:])
    with pytest.raises(DataLoss):
        fetch_all(shard, [key2], (16,))
    assert shard.lookup(SPACE, LAYOUT, second).cached_tokens == 0
    assert shard.usage() == {}


def test_two_phase_put_is_invisible_until_commit_and_checked(tmp_path):
    shard = make(tmp_path)
    tokens = list(range(32))
    session = shard.begin_put(SPACE, LAYOUT, tokens, [0, 1], "a", no_quota)
    size = LAYOUT.segment_bytes(16)
    for layer in range(LAYOUT.num_layers):
        session.add(layer, 0, b"\x01" * size)
    assert shard.lookup(SPACE, LAYOUT, tokens).cached_tokens == 0
    with pytest.raises(InvalidArgument, match="segments are missing"):
        session.commit([0, 0])
    for layer in range(LAYOUT.num_layers):
        session.add(layer, 1, b"\x02" * size)
    with pytest.raises(InvalidArgument, match="arrived corrupted"):
        session.commit([0, 0])
    assert shard.lookup(SPACE, LAYOUT, tokens).cached_tokens == 0 and shard.usage() == {}


@pytest.mark.parametrize(
    "layer, chunk, size, message",
    [
        (4, 0, None, "segment.layer"),
        (0, 2, None, "segment.chunk"),
        (0, 0, 10, "segment.data"),
    ],
)
def test_bad_segments_are_rejected_with_the_field_named(tmp_path, layer, chunk, size, message):
    shard = make(tmp_path)
    session = shard.begin_put(SPACE, LAYOUT, list(range(32)), [0, 1], "a", no_quota)
    with pytest.raises(InvalidArgument, match=message):
        session.add(layer, chunk, b"\x00" * (size or LAYOUT.segment_bytes(16)))


def test_quota_is_checked_before_data_and_at_commit(tmp_path):
    shard = make(tmp_path)

    def quota(owner):
        return Allowance(quota=3 * CHUNK, elsewhere=0)

    put(shard, list(range(32)), quota=quota)
    with pytest.raises(QuotaExceeded, match=f"{2 * CHUNK} bytes stored"):
        put(shard, list(range(100, 132)), quota=quota)  # refused before any data arrives
    assert shard.usage() == {"a": 2 * CHUNK}
    assert shard.lookup(SPACE, LAYOUT, list(range(100, 132))).cached_tokens == 0
    put(shard, list(range(32)), quota=quota)  # already stored: costs nothing, allowed


def test_a_chunk_being_removed_is_a_miss_and_cannot_be_re_put_until_it_is_gone(tmp_path):
    shard = make(tmp_path)
    tokens = list(range(16))
    (keys, _), _ = put(shard, tokens)
    stream = shard.fetch(SPACE, LAYOUT, [ChunkRef(keys[0], 16)], 0, 4, 64 * 1024)
    next(stream)  # leased
    assert shard.delete(SPACE, LAYOUT, tokens)[0] == 1  # removal waits for the lease
    assert shard.lookup(SPACE, LAYOUT, tokens).cached_tokens == 0
    with pytest.raises(NotFound):
        fetch_all(shard, keys, (16,))
    with pytest.raises(Unavailable, match="being removed"):
        put(shard, tokens)
    stream.close()  # the lease ends: the chunk is gone, and can be stored again
    assert shard.usage() == {}
    put(shard, tokens)
    assert shard.lookup(SPACE, LAYOUT, tokens).cached_tokens == 16


def test_undoing_a_put_keeps_chunks_that_another_put_committed_meanwhile(tmp_path):
    shard = make(tmp_path)
    shared, own = list(range(16)), list(range(16)) + list(range(500, 516))
    (keys_a, _), _ = put(shard, shared)  # publish A stores chunk 0
    put(shard, own)  # publish B commits chunk 0 (present) and its own chunk 1
    writer = Deletable("a")  # both puts were tenant a's
    assert shard.delete_keys(SPACE, keys_a, writer)[0] == 0  # A fails elsewhere and undoes
    assert shard.lookup(SPACE, LAYOUT, own).cached_tokens == 32  # B's prefix is whole
    lone = list(range(900, 916))
    (keys_c, _), _ = put(shard, lone)
    assert shard.delete_keys(SPACE, keys_c, writer)[0] == 1  # nobody else relied on it
    assert shard.lookup(SPACE, LAYOUT, lone).cached_tokens == 0


def test_fetch_of_a_missing_chunk_and_bad_layer_ranges(tmp_path):
    shard = make(tmp_path)
    with pytest.raises(NotFound, match=r"chunks\[0\]"):
        fetch_all(shard, [1234], (16,))
    with pytest.raises(InvalidArgument, match="layer range"):
        next(shard.fetch(SPACE, LAYOUT, [ChunkRef(1, 16)], 2, 9, 65536))


def test_delete_removes_the_prefix_and_its_artifacts(tmp_path):
    shard = make(tmp_path)
    tokens = list(range(40))
    (keys, _), _ = put(shard, tokens)
    shard.put_artifact(SPACE, LAYOUT, keys[-1], 40, "snapkv:budget=0.125", b"abc", "a", no_quota)
    assert shard.fetch_artifact(SPACE, LAYOUT, keys[-1], "snapkv:budget=0.125")[:2] == (b"abc", 40)
    chunks, artifacts, _ = shard.delete(SPACE, LAYOUT, tokens)
    assert (chunks, artifacts) == (3, 1)
    assert shard.lookup(SPACE, LAYOUT, tokens).cached_tokens == 0 and shard.usage() == {}
