"""What a shard holds, under one lock: its blobs placed in the tiers, the leases and claims
on them, each owner's usage and the index of partial chunks, kept true together.

Index changes happen under the lock; bytes are copied out of leased blobs without it, and
disk writes and removals happen after the change that staged them, also without it
(`Holdings.mutating`).
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefix_store.blob import Blob, BlobId
from prefix_store.config import ShardConfig
from prefix_store.errors import StoreFull, Unavailable
from prefix_store.shard.claims import Claims
from prefix_store.shard.leases import Leases
from prefix_store.shard.lookup import PartialChunks
from prefix_store.shard.placement import Placement
from prefix_store.shard.usage import ShardStats, charge, discharge
from prefix_store.tiers import DiskTier, MemoryTier
from prefix_store.tiers.disk import DiskIO, Write

ACCOUNTING_SLICE = 4096
"""Blobs `accounting` sums per turn of the lock."""


class Holdings:
    def __init__(self, config: ShardConfig) -> None:
        self.shard_id = config.shard_id
        self.lock = threading.RLock()
        self.leases = Leases()
        self.claims = Claims()
        self.partials = PartialChunks()
        self.stats = ShardStats()
        memory = MemoryTier(config.memory_bytes, self.leases.held)
        disk_dir = Path(config.disk_dir) if config.disk_dir else Path("/nonexistent")
        disk = DiskTier(disk_dir, config.disk_bytes, self.leases.held)
        self.placement = Placement(memory, disk, self.stats, self._gone)
        self._depth = 0  # nesting of `mutating` in the thread that holds the lock
        for blob_id in disk.ids():
            self._admitted(disk.get(blob_id))

    # ---- changes and their disk I/O ----------------------------------------------------

    @contextmanager
    def mutating(self) -> Iterator[list[Write]]:
        """The lock, for a change of what the shard holds. The disk writes and removals
        the change staged are done when the outermost such block ends, after the lock is
        released, by this thread before it goes on. Yields a list that then holds the
        writes that failed (their blobs forgotten, their usage released)."""
        failed: list[Write] = []
        with self.lock:
            self._depth += 1
            try:
                yield failed
            finally:
                self._depth -= 1
                io = self.placement.disk.take_io() if self._depth == 0 else DiskIO()
        failed.extend(self._do_disk_io(io))

    def _do_disk_io(self, io: DiskIO) -> list[Write]:
        disk, failed = self.placement.disk, []
        while io:
            disk.perform(io)
            with self.lock:
                for write in io.writes:
                    if disk.settle(write):
                        failed.append(write)
                        if write.blob.id not in self.placement.memory:
                            self._gone(write.blob)
                io = disk.take_io()
        return failed

    def settle_change(self, failed: list[Write], new: list[Blob]) -> None:
        """After a change: blobs it evicted whose disk write failed are lost like any
        evicted blob (counted); if a blob it stored itself could not be written, the change
        is undone as a whole (its other new blobs dropped unless another put claims them)
        and fails: StoreFull when the disk is full, else Unavailable."""
        if not failed:
            return  # the common case: no second trip through the lock
        new_ids = {b.id for b in new}
        own = [w for w in failed if w.blob.id in new_ids]
        with self.mutating():
            self.stats.lost_spills += len(failed) - len(own)
            if not own:
                return
            lost_ids = {w.blob.id for w in own}
            for blob in new:
                claimed = self.claims.unclaim(blob.id, blob.owner) > 0
                if claimed or blob.id in lost_ids:
                    continue
                if self.placement.find(blob.id) is not None:
                    self.drop(blob.id)
        error = own[0].error  # its message names no path: callers are tenants
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFull(f"shard {self.shard_id}: the disk tier is full")
        raise Unavailable(
            f"shard {self.shard_id}: writing to the disk tier failed "
            f"({error.strerror or type(error).__name__}); nothing was stored, retry"
        )

    # ---- blobs (under the lock) --------------------------------------------------------

    def find_live(self, blob_id: BlobId) -> Blob | None:
        """A blob readers may use: not one waiting for its leases to end before removal."""
        return None if self.leases.doomed(blob_id) else self.placement.find(blob_id)

    def read_live(self, blob_id: BlobId) -> Blob | None:
        """As `find_live`, for a read: the blob becomes the most recently used."""
        return None if self.leases.doomed(blob_id) else self.placement.touch(blob_id)

    def place(self, blob: Blob) -> None:
        """Store a new blob (StoreFull when no tier can take it)."""
        if not self.placement.place(blob):
            raise StoreFull(f"shard {self.shard_id}: no room for {blob.nbytes} bytes")
        self._admitted(blob)

    def drop(self, blob_id: BlobId) -> Blob | None:
        """Remove a blob from both tiers (deferred while leased: doomed meanwhile)."""
        if self.leases.held(blob_id):
            self.leases.doom(blob_id)
            return self.placement.find(blob_id)
        blob = self.placement.remove(blob_id)
        if blob is not None:
            self._gone(blob)
        return blob

    def condemn(self, blob_id: BlobId) -> None:
        """A blob failed its checksum: unreadable from now, removed once no read holds it."""
        self.leases.doom(blob_id)
        if not self.leases.held(blob_id):
            self.leases.pardon(blob_id)
            self.drop(blob_id)

    def release(self, blob_ids: list[BlobId]) -> None:
        """End one lease on each blob; doomed blobs go with their last lease."""
        with self.mutating():
            for blob_id in blob_ids:
                if self.leases.give_back(blob_id):
                    self.drop(blob_id)

    def flush(self) -> int:
        """As `Shard.flush`."""
        written = 0
        with self.mutating() as failed:
            if not self.placement.disk.capacity:
                return 0
            for blob_id in self.placement.memory.ids():
                written += self.placement.write_back(self.placement.memory.get(blob_id))
        return written - len(failed)

    # ---- what is held (for operators) --------------------------------------------------

    def ids(self) -> list[BlobId]:
        """Every blob held now, once each."""
        with self.lock:
            return list(dict.fromkeys(self.placement.ids()))

    def accounting(self) -> tuple[int, int]:
        """As `Shard.accounting`."""
        with self.lock:
            ids = self.placement.ids()
        held, seen = 0, set()
        for start in range(0, len(ids), ACCOUNTING_SLICE):
            with self.lock:
                for blob_id in ids[start : start + ACCOUNTING_SLICE]:
                    blob = None if blob_id in seen else self.placement.find(blob_id)
                    seen.add(blob_id)
                    held += blob.nbytes if blob is not None else 0
        with self.lock:
            return held, sum(self.stats.usage.values())

    def counts(self, owner: str | None = None) -> dict[str, int]:
        """As `Shard.counts`."""
        with self.lock:
            ids = set(self.placement.ids())
            if owner is not None:
                ids = {i for i in ids if self.placement.find(i).owner == owner}
            return {
                "chunks": sum(1 for i in ids if i[0] == "chunk"),
                "artifacts": sum(1 for i in ids if i[0] == "artifact"),
                "leased": len(self.leases),
            }

    # ---- bookkeeping -------------------------------------------------------------------

    def _admitted(self, blob: Blob) -> None:
        charge(self.stats.usage, blob)
        self.partials.add(blob)

    def _gone(self, blob: Blob) -> None:
        self.claims.forget(blob.id)
        discharge(self.stats.usage, blob)
        self.partials.discard(blob)
