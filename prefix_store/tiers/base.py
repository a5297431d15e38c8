"""What every storage tier of a shard is: a byte-bounded LRU index of blobs."""

from __future__ import annotations

from typing import Protocol

from prefix_store.blob import Blob, BlobId


class Tier(Protocol):
    """Blobs held within `capacity` bytes, least recently used first. Not thread-safe: the
    shard serialises every call under its lock (a tier's own I/O aside, see `DiskTier`).

    A tier is built with `leased(id)`, and never evicts a blob for which it is true. How a
    blob is added is the tier's own (`MemoryTier.insert`, `DiskTier.write`: a staged write);
    the caller has made room for it first (`fits`, `make_room`)."""

    capacity: int
    """Bytes it may hold (0: a disabled tier)."""
    used: int
    """Bytes it holds now."""

    def __contains__(self, blob_id: BlobId) -> bool: ...

    def __len__(self) -> int: ...

    def ids(self) -> list[BlobId]:
        """Every blob held, least recently used first."""
        ...

    def get(self, blob_id: BlobId) -> Blob | None:
        """The blob, now the most recently used (a read); None: not held."""
        ...

    def peek(self, blob_id: BlobId) -> Blob | None:
        """The blob, its recency unchanged (bookkeeping); None: not held."""
        ...

    def fits(self, nbytes: int) -> bool:
        """Whether room for `nbytes` could be made without touching leased blobs."""
        ...

    def make_room(self, nbytes: int) -> list[Blob]:
        """Remove unleased blobs, least recently used first, until `nbytes` fit; returns
        them (the caller spills or forgets them)."""
        ...

    def remove(self, blob_id: BlobId) -> Blob | None:
        """Forget the blob; returns it (None: not held)."""
        ...
