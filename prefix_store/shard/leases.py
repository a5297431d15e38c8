"""Leases on a shard's blobs: a blob being read is never evicted or removed under its
reader; one removed meanwhile is doomed (unreadable) and goes when its last lease ends.
Not thread-safe: the shard's holdings call it under their lock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from prefix_store.blob import Blob, BlobId
from prefix_store.errors import Unavailable


class Leases:
    def __init__(self) -> None:
        self._count: Counter = Counter()
        self._doomed: set[BlobId] = set()

    def __len__(self) -> int:
        """How many blobs are leased."""
        return len(self._count)

    def held(self, blob_id: BlobId) -> bool:
        """Whether the blob is leased (the tiers' `leased`)."""
        return self._count[blob_id] > 0

    def doomed(self, blob_id: BlobId) -> bool:
        """Whether the blob waits for its leases to end before it is removed."""
        return blob_id in self._doomed

    def take(self, blob_ids: Iterable[BlobId]) -> None:
        for blob_id in blob_ids:
            self._count[blob_id] += 1

    def give_back(self, blob_id: BlobId) -> bool:
        """End one lease; True when it was the last one of a doomed blob (remove it now)."""
        self._count[blob_id] -= 1
        if self._count[blob_id] > 0:
            return False
        del self._count[blob_id]
        return self.pardon(blob_id)

    def doom(self, blob_id: BlobId) -> None:
        self._doomed.add(blob_id)

    def pardon(self, blob_id: BlobId) -> bool:
        """Take the blob off the doomed list; whether it was on it."""
        doomed = blob_id in self._doomed
        self._doomed.discard(blob_id)
        return doomed

    def refuse_leased(self, blob_ids: Iterable[BlobId]) -> None:
        """Unavailable when one of the blobs (that a signed put would replace) is read now."""
        for blob_id in blob_ids:
            if self.held(blob_id):
                raise Unavailable(
                    f"{blob_id[0]} {blob_id[2]:016x} is being read; retry the signed put shortly"
                )

    def refuse_doomed(self, blobs: Iterable[Blob]) -> None:
        """Unavailable when one of the blobs is still being removed."""
        for blob in blobs:
            if blob.id in self._doomed:
                raise Unavailable(
                    f"{blob.kind} {blob.id[2]:016x} is being removed (reads still hold it); "
                    "retry shortly"
                )
