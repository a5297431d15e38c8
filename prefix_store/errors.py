"""Typed store errors. Each maps to exactly one gRPC status code (see `status.py`).

A miss is not an error: lookups return what they found. These are failures the caller
must handle; every message names the field or object at fault.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the prefix store raises on purpose."""


class InvalidArgument(StoreError):
    """A malformed request: bad shape, dtype, size, layout or an oversized message."""


class NotFound(StoreError):
    """Absent, or not visible to the caller (another tenant's data looks absent)."""


class Unauthenticated(StoreError):
    """Missing, malformed or unknown bearer token."""


class PermissionDenied(StoreError):
    """The caller's role in a namespace does not allow the call (a reader storing)."""


class QuotaExceeded(StoreError):
    """A tenant's stored bytes would exceed its quota; the message carries the usage."""


class LimitExceeded(StoreError):
    """A caller holds as many concurrent calls as it may (or the server as many as it
    serves); the message names the limit."""


class StoreFull(StoreError):
    """Neither tier can take the data right now (everything left is leased)."""


class Unavailable(StoreError):
    """A shard or the metadata plane cannot be reached; retrying elsewhere may work."""


class DataLoss(StoreError):
    """Stored bytes failed their checksum; the chunk has been dropped (now a miss)."""


class CorruptInTransit(DataLoss):
    """Bytes arrived different from the checksum sent with them: corrupted on the way, the
    stored copy untouched (the client reads a replica). Its status is DATA_LOSS."""


class KernelMismatch(StoreError):
    """A shard cannot compute attention partials with the caller's kernel (it has none, or
    another one, whose bits would differ): the caller pulls the KV instead."""


class DeadlineExceeded(StoreError):
    """A stream fell below its minimum rate or passed its absolute deadline (see
    `prefix_store.pace`): it was cut and nothing of it was stored."""


class Aborted(StoreError):
    """A two-phase put ended before its commit; nothing of it was stored."""
