"""Claims on a shard's chunks: per blob, the owners whose puts committed it since the
process started, and how many times each. Undoing a put (`Shard.delete_keys`) takes one of
its owner's claims and drops the chunk only when no put claims it any more. Not
thread-safe: the shard's holdings call it under their lock."""

from __future__ import annotations

from collections import Counter

from prefix_store.blob import BlobId


class Claims:
    def __init__(self) -> None:
        self._owners: dict[BlobId, Counter] = {}

    def __len__(self) -> int:
        """How many blobs are claimed."""
        return len(self._owners)

    def claim(self, blob_id: BlobId, owner: str) -> None:
        self._owners.setdefault(blob_id, Counter())[owner] += 1

    def unclaim(self, blob_id: BlobId, owner: str) -> int:
        """Take one of `owner`'s claims on a blob (if it has one); the claims left."""
        claims = self._owners.get(blob_id)
        if claims is None:
            return 0
        if claims[owner] > 0:
            claims[owner] -= 1
            if claims[owner] <= 0:
                del claims[owner]
        if not claims:
            del self._owners[blob_id]
        return sum(claims.values())

    def forget(self, blob_id: BlobId) -> None:
        """The blob is gone: no claim on it is kept."""
        self._owners.pop(blob_id, None)
