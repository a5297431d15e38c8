"""The memory tier: blobs in host memory, least recently used evicted first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from prefix_store.blob import Blob, BlobId


class MemoryTier:
    """Holds at most `capacity` bytes. Not thread-safe: the shard serialises access.

    `make_room` never evicts a blob for which `leased(id)` is true; it returns the blobs
    it removed (least recently used first) so the caller can spill them."""

    def __init__(self, capacity: int, leased: Callable[[BlobId], bool]) -> None:
        self.capacity = capacity
        self._leased = leased
        self._blobs: OrderedDict[BlobId, Blob] = OrderedDict()
        self.used = 0

    def __contains__(self, blob_id: BlobId) -> bool:
        return blob_id in self._blobs

    def __len__(self) -> int:
        return len(self._blobs)

    def ids(self) -> list[BlobId]:
        return list(self._blobs)

    def get(self, blob_id: BlobId) -> Blob | None:
        """The blob (now most recently used), or None."""
        blob = self._blobs.get(blob_id)
        if blob is not None:
            self._blobs.move_to_end(blob_id)
        return blob

    def peek(self, blob_id: BlobId) -> Blob | None:
        """The blob, or None, leaving its recency as it is (bookkeeping, not a read)."""
        return self._blobs.get(blob_id)

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` could be made room for without touching leased blobs."""
        free = self.capacity - self.used
        free += sum(b.nbytes for i, b in self._blobs.items() if not self._leased(i))
        return nbytes <= free

    def make_room(self, nbytes: int) -> list[Blob]:
        """Evict unleased blobs, least recently used first, until `nbytes` fit."""
        victims = []
        for blob_id in list(self._blobs):
            if self.used + nbytes <= self.capacity:
                break
            if not self._leased(blob_id):
                victims.append(self.remove(blob_id))
        return victims

    def insert(self, blob: Blob) -> None:
        """Add a blob; the caller has made room for it."""
        assert blob.data is not None and blob.id not in self._blobs
        self._blobs[blob.id] = blob
        self.used += blob.nbytes

    def remove(self, blob_id: BlobId) -> Blob | None:
        blob = self._blobs.pop(blob_id, None)
        if blob is not None:
            self.used -= blob.nbytes
        return blob
