"""Usage and quota: the bytes each owner's blobs hold on a shard, what the shard counts,
and the check of an owner's quota (its bytes here and elsewhere) against a change."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from prefix_store.blob import Blob
from prefix_store.errors import QuotaExceeded


@dataclass(frozen=True, slots=True)
class Allowance:
    """What the metadata plane says about an owner: its quota and its bytes elsewhere."""

    quota: int
    elsewhere: int
    """Bytes the owner stores on the other live shards."""


# quota(owner) -> the owner's Allowance, or None when unlimited. It may do network I/O,
# so the shard calls it before taking its lock and checks its own usage under the lock.
QuotaCheck = Callable[[str], Allowance | None]


@dataclass
class ShardStats:
    hits: int = 0
    misses: int = 0
    fetched_bytes: int = 0
    received_bytes: int = 0
    """Bytes of committed puts (chunks and artifacts), already held ones included."""
    stored_bytes: int = 0
    """Of which new to this shard."""
    evictions: int = 0
    dropped: int = 0
    """Blobs that left the shard without a delete: evicted from memory with no room on disk,
    or from the disk tier to make room (a later read misses them: the cache's choice)."""
    corrupt: int = 0
    scrubbed_bytes: int = 0
    """Bytes at rest the scrubber re-checked (`prefix_store.scrub`)."""
    scrub_corrupt: int = 0
    """Of `corrupt`, blobs the scrubber found (dropped before any read met them)."""
    lost_spills: int = 0
    """Blobs evicted from memory whose disk write failed (dropped, like an eviction)."""
    usage: Counter = field(default_factory=Counter)
    """Bytes each owner's blobs hold here (`charge`, `discharge`)."""


def charge(usage: Counter, blob: Blob) -> None:
    """A blob came to the shard: its owner uses its bytes."""
    usage[blob.owner] += blob.nbytes


def discharge(usage: Counter, blob: Blob) -> None:
    """A blob left the shard: its owner no longer uses its bytes."""
    usage[blob.owner] -= blob.nbytes
    if usage[blob.owner] <= 0:
        del usage[blob.owner]


def check_quota(usage: Counter, owner: str, allowance: Allowance | None, new_bytes: int) -> None:
    """QuotaExceeded when `new_bytes` more would take `owner` past its quota (its usage here
    and elsewhere counted); None: unlimited."""
    if allowance is None or new_bytes == 0:
        return
    used = allowance.elsewhere + usage.get(owner, 0)
    if used + new_bytes > allowance.quota:
        raise QuotaExceeded(
            f"tenant {owner!r}: {used} bytes stored + {new_bytes} new bytes exceed "
            f"its quota of {allowance.quota} bytes"
        )
