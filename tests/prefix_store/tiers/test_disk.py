"""The disk tier under crashes and failures: what reaches disk is durable (fsynced file and
directory), the start-up scan survives anything left in the directory, a full disk fails
only the put that needs it, and no disk I/O holds the shard's lock. Real files; a real
full filesystem (a small tmpfs, root only)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import threading
import time

import pytest

from prefix_store.config import ShardConfig
from prefix_store.errors import StoreFull, Unavailable
from prefix_store.shard import ChunkRef, Shard
from prefix_store.tiers import disk
from prefix_store.tiers.disk import MAGIC, DiskTier
from tests.prefix_store.test_shard import CHUNK, LAYOUT, SPACE, fetch_all, make, put

PROMPTS = [list(range(100 * i, 100 * i + 16)) for i in range(6)]  # one full chunk each


def assert_consistent(shard: Shard) -> None:
    """Memory, disk, files and usage accounting agree, and a restart finds the same blobs."""
    root = shard.disk.root
    assert len(list(root.glob("*.blob"))) == len(shard.disk)
    assert not list(root.glob("*.tmp"))
    held = set(shard.memory.ids()) | set(shard.disk.ids())
    assert shard.disk.used == sum(shard.disk.get(i).nbytes for i in shard.disk.ids())
    assert sum(shard.usage().values()) == sum(shard.holdings.placement.find(i).nbytes for i in held)
    again = Shard(shard.config)
    assert set(again.disk.ids()) == set(shard.disk.ids()) and not again.disk.rejected


def test_a_spilled_blob_is_fsynced_renamed_and_its_directory_fsynced(tmp_path, monkeypatch):
    shard = make(tmp_path, memory_chunks=1, disk_chunks=4)
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    put(shard, PROMPTS[0])
    assert events == []  # in memory only
    put(shard, PROMPTS[1])  # spills the first
    (final,) = (tmp_path / "s").glob("*.blob")
    assert [kind for kind, _ in events] == ["fsync", "rename", "fsync"]
    assert events[0][1].endswith(".tmp") and events[1][1] == str(final)
    assert events[2][1] == str(tmp_path / "s")  # the directory entry is durable too
    assert_consistent(shard)


def test_blobs_and_their_directory_are_readable_by_the_owner_alone(tmp_path):
    """A blob's header holds its tenant's token ids: 0600 whatever the umask, in a 0700
    directory (tightened when it exists wider)."""
    (tmp_path / "s").mkdir(mode=0o755)
    previous = os.umask(0o022)
    try:
        shard = make(tmp_path, memory_chunks=1, disk_chunks=4)
        put(shard, PROMPTS[0])
        put(shard, PROMPTS[1])  # spills the first
    finally:
        os.umask(previous)
    (blob,) = (tmp_path / "s").glob("*.blob")
    assert stat.S_IMODE(blob.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700


def write_raw(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(text)) + text + data)


def test_start_up_skips_reports_and_removes_whatever_it_cannot_read(tmp_path):
    shard = make(tmp_path, memory_chunks=4, disk_chunks=8)
    (keys, _), sent = put(shard, PROMPTS[0])
    put(shard, PROMPTS[1])
    assert shard.flush() == 2
    root = tmp_path / "s"
    good = sorted(root.glob("*.blob"))
    header = json.loads(
        good[0].read_bytes()[8 : 8 + struct.unpack("<I", good[0].read_bytes()[4:8])[0]]
    )
    truncated = root / "truncated.blob"
    truncated.write_bytes(good[1].read_bytes()[:-100])
    good[1].unlink()  # the prompt-1 chunk survives only as a truncated file
    (root / "foreign.blob").write_bytes(b"not a blob at all")
    (root / "short.blob").write_bytes(MAGIC + b"\x01")  # struct.error territory
    (root / "badjson.blob").write_bytes(MAGIC + struct.pack("<I", 3) + b"{x]")
    write_raw(root / "layout.blob", {**header, "layout": {"nonsense": 1}}, b"")
    orphan = {**header, "tokens": header["tokens"][:8], "meta": {}}  # partial, no parent
    write_raw(root / "orphan.blob", orphan, b"\0" * (header["segment_bytes"] * len(header["crcs"])))
    (root / "half-written.tmp").write_bytes(b"partial")

    again = make(tmp_path, memory_chunks=4, disk_chunks=8)
    rejected = {name for name, _ in again.disk.rejected}
    assert rejected == {
        "truncated.blob",
        "foreign.blob",
        "short.blob",
        "badjson.blob",
        "layout.blob",
        "orphan.blob",
    }
    assert sorted(p.name for p in root.iterdir()) == [good[0].name]
    assert fetch_all(again, keys, (16,)) == sent
    assert again.lookup(SPACE, LAYOUT, PROMPTS[1]).cached_tokens == 0
    assert_consistent(again)


def test_of_two_copies_of_one_blob_the_newer_is_kept(tmp_path):
    shard = make(tmp_path, memory_chunks=4, disk_chunks=8)
    put(shard, PROMPTS[0])
    shard.flush()
    root = tmp_path / "s"
    (older,) = root.glob("*.blob")
    newer = root / older.name.replace(".blob", "x.blob")
    shutil.copy(older, newer)
    os.utime(older, (time.time() - 60, time.time() - 60))
    again = make(tmp_path, memory_chunks=4, disk_chunks=8)
    assert [p.name for p in root.glob("*.blob")] == [newer.name]
    assert len(again.disk) == 1 and sum(again.usage().values()) == CHUNK


@pytest.fixture
def full_soon(tmp_path):
    """A real filesystem with room for two blob files: a tmpfs, mostly filled (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "fs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (mount / "shard").mkdir()
        fs = os.statvfs(mount)
        page = fs.f_frsize
        blob_file = -(-(CHUNK + 1024) // page) * page  # the data and its header, in pages
        with open(mount / "filler", "wb") as f:
            f.write(b"\0" * (fs.f_bavail * page - 2 * blob_file))
            f.flush()
            os.fsync(f.fileno())
        yield mount / "shard"
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def test_a_full_disk_fails_only_the_put_that_needs_it_and_accounting_stays_true(full_soon):
    shard = Shard(
        ShardConfig(shard_id="s", memory_bytes=CHUNK, disk_bytes=16 * CHUNK, disk_dir=full_soon)
    )
    (k0, _), s0 = put(shard, PROMPTS[0])
    for prompt in PROMPTS[1:4]:  # each spills the previous one; the third spill hits ENOSPC
        put(shard, prompt)
    assert len(shard.disk) == 2 and shard.stats.lost_spills == 1
    assert shard.disk.write_errors == 1
    assert fetch_all(shard, k0, (16,)) == s0  # what was written reads back whole
    assert_consistent(shard)

    (k3, _), _ = put(shard, PROMPTS[3])  # already stored: nothing to write
    stream = shard.open_fetch(SPACE, LAYOUT, [ChunkRef(k3[0], 16)], 0, LAYOUT.num_layers)
    try:  # memory holds a leased blob, so a new put must go to the full disk
        with pytest.raises(StoreFull, match="disk tier is full"):
            put(shard, PROMPTS[4])
        assert shard.lookup(SPACE, LAYOUT, PROMPTS[4]).cached_tokens == 0
        assert_consistent(shard)
    finally:
        stream.close()
    put(shard, PROMPTS[4])  # memory has room again: served, spilling with loss counted
    assert shard.lookup(SPACE, LAYOUT, PROMPTS[4]).cached_tokens == 16
    assert_consistent(shard)


class Gate:
    """Holds every disk write until opened (a slow disk), counting writes waiting."""

    def __init__(self, monkeypatch):
        self.open, self.waiting = threading.Event(), threading.Semaphore(0)
        real = disk.write_file

        def slow(write):
            self.waiting.release()
            assert self.open.wait(30)
            real(write)

        monkeypatch.setattr(disk, "write_file", slow)


def test_disk_writes_do_not_hold_the_shard_lock(tmp_path, monkeypatch):
    shard = make(tmp_path, memory_chunks=1, disk_chunks=8)
    (keys, _), sent = put(shard, PROMPTS[0])
    gate = Gate(monkeypatch)
    spilling = threading.Thread(target=put, args=(shard, PROMPTS[1]))
    spilling.start()
    assert gate.waiting.acquire(timeout=30)  # the spill of PROMPTS[0] is writing
    # Meanwhile the shard answers: lookups, fetches (of the blob being written, from
    # memory), other puts' checks.
    assert shard.lookup(SPACE, LAYOUT, PROMPTS[0]).cached_tokens == 16
    assert fetch_all(shard, keys, (16,)) == sent
    assert shard.lookup(SPACE, LAYOUT, PROMPTS[1]).cached_tokens == 16
    gate.open.set()
    spilling.join(30)
    assert fetch_all(shard, keys, (16,)) == sent  # now from disk
    assert_consistent(shard)


def test_a_blob_removed_while_its_write_is_in_flight_leaves_no_file(tmp_path, monkeypatch):
    shard = make(tmp_path, memory_chunks=1, disk_chunks=8)
    put(shard, PROMPTS[0])
    gate = Gate(monkeypatch)
    spilling = threading.Thread(target=put, args=(shard, PROMPTS[1]))
    spilling.start()
    assert gate.waiting.acquire(timeout=30)
    assert shard.delete(SPACE, LAYOUT, PROMPTS[0])[0] == 1
    gate.open.set()
    spilling.join(30)
    assert shard.lookup(SPACE, LAYOUT, PROMPTS[0]).cached_tokens == 0
    assert not list((tmp_path / "s").glob("*.blob"))
    assert_consistent(shard)


def test_replacing_an_artifact_being_read_waits_for_the_read_and_keeps_the_new_one(
    tmp_path, monkeypatch
):
    shard = make(tmp_path, memory_chunks=0, disk_chunks=8)  # artifacts live on disk
    spec, old, new = "snapkv:budget=0.125", b"old" * 100, b"new" * 100

    def store(data):
        return shard.put_artifact(SPACE, LAYOUT, 7, 40, spec, data, "a", lambda owner: None)

    store(old)
    reading, release = threading.Event(), threading.Event()
    real = DiskTier.read_segment

    def slow_read(self, blob_id, index):
        reading.set()
        assert release.wait(30)
        return real(self, blob_id, index)

    monkeypatch.setattr(DiskTier, "read_segment", slow_read)
    got = []
    reader = threading.Thread(
        target=lambda: got.append(shard.fetch_artifact(SPACE, LAYOUT, 7, spec))
    )
    reader.start()
    assert reading.wait(30)  # the read holds its lease
    with pytest.raises(Unavailable, match="being read"):
        store(new)
    release.set()
    reader.join(30)
    assert got[0][0] == old  # the read got whole, unchanged bytes
    monkeypatch.setattr(DiskTier, "read_segment", real)
    store(new)  # the retry succeeds once the lease has ended
    assert shard.fetch_artifact(SPACE, LAYOUT, 7, spec)[0] == new
    assert_consistent(shard)
