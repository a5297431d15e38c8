"""Placement and the spill policy: where a shard's blobs live across its two tiers.

A new blob goes to memory when room can be made there, evicting the least recently used
unleased blobs, else straight to disk. A blob evicted from memory spills to disk when the
disk tier can take it (its own least recently used blobs removed for it), else it leaves
the shard. Not thread-safe: the holdings call it under their lock; `gone(blob)` is told of
every blob that leaves both tiers.
"""

from __future__ import annotations

from collections.abc import Callable

from prefix_store.blob import Blob, BlobId
from prefix_store.shard.usage import ShardStats
from prefix_store.tiers import DiskTier, MemoryTier


class Placement:
    def __init__(
        self, memory: MemoryTier, disk: DiskTier, stats: ShardStats, gone: Callable[[Blob], None]
    ) -> None:
        self.memory, self.disk = memory, disk
        self.stats, self._gone = stats, gone

    def ids(self) -> list[BlobId]:
        """Every blob held, memory's first (one held in both tiers is listed twice)."""
        return self.memory.ids() + self.disk.ids()

    def find(self, blob_id: BlobId) -> Blob | None:
        """The blob, its recency unchanged (bookkeeping: only reads count as use)."""
        return self.memory.peek(blob_id) or self.disk.peek(blob_id)

    def touch(self, blob_id: BlobId) -> Blob | None:
        """The blob, now the most recently used in its tier (a read)."""
        return self.memory.get(blob_id) or self.disk.get(blob_id)

    def room_for(self, nbytes: int) -> bool:
        return self.memory.fits(nbytes) or bool(self.disk.capacity and self.disk.fits(nbytes))

    def place(self, blob: Blob) -> bool:
        """Store a new blob: memory if it fits (spilling LRU blobs), else disk; False when
        neither can take it."""
        if self.memory.fits(blob.nbytes):
            self._spill(self.memory.make_room(blob.nbytes))
            self.memory.insert(blob)
        elif self.disk.capacity and self.disk.fits(blob.nbytes):
            self._write(blob)
        else:
            return False
        return True

    def remove(self, blob_id: BlobId) -> Blob | None:
        """Take a blob out of both tiers; the blob, or None when neither held it."""
        in_memory = self.memory.remove(blob_id)
        on_disk = self.disk.remove(blob_id)
        return in_memory or on_disk

    def write_back(self, blob: Blob) -> bool:
        """Stage a memory blob's write to disk (a graceful shutdown); False when it is
        there already or the disk cannot take it."""
        if blob.id in self.disk or not self.disk.fits(blob.nbytes):
            return False
        self._write(blob)
        return True

    def _spill(self, victims: list[Blob]) -> None:
        """Move blobs evicted from memory to disk; drop them if disk has no room."""
        for blob in victims:
            self.stats.evictions += 1
            if blob.id in self.disk:
                continue
            if self.disk.capacity and self.disk.fits(blob.nbytes):
                self._write(blob)
            else:
                self.stats.dropped += 1
                self._gone(blob)

    def _write(self, blob: Blob) -> None:
        """Make room on disk (blobs it removes that memory does not hold leave the shard)
        and stage the blob's write."""
        for dropped in self.disk.make_room(blob.nbytes):
            if dropped.id not in self.memory:
                self.stats.dropped += 1
                self._gone(dropped)
        self.disk.write(blob)
