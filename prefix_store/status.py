"""The store's status table: which gRPC status code each store error is (`CODES`), read
forwards by servers (`rpc.status.STORE`) and backwards by clients (`error_of`), with the
trailing metadata both ends know and the codes a client retries or fails over on."""

from __future__ import annotations

import grpc

from prefix_store import errors

REQUEST_ID = "x-request-id"
"""Trailing metadata of a call that failed INTERNAL: the id its server logged it under."""
RETRY_AFTER = "retry-after-ms"
"""Trailing metadata of a call refused by a server's call limits (RESOURCE_EXHAUSTED,
`LimitExceeded`): milliseconds after which the caller may try again. Only such refusals
carry it: an exceeded quota or a full store is not worth retrying."""
BUSY_RETRY_MS = 100

CODES: dict[type[errors.StoreError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.StoreFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.KernelMismatch: grpc.StatusCode.FAILED_PRECONDITION,
}

_ERRORS: dict[grpc.StatusCode, type[errors.StoreError]] = {
    code: cls for cls, code in CODES.items() if cls not in (errors.StoreFull, errors.LimitExceeded)
}

# Codes on which a client may try again (same shard after backoff, or a replica).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
# Codes on which a fetch stream moves to the next replica of its chunks (from its first
# incomplete layer) instead of failing: the shard is gone, slow, corrupt or lacks the chunk.
FAILOVER = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    }
)


def busy_retry_s(error: BaseException) -> float | None:
    """Seconds after which a call its server refused as busy (`RETRY_AFTER`) may be tried
    again; None for any other failure."""
    if not isinstance(error, grpc.RpcError) or error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER:
            try:
                return max(0, int(value)) / 1000
            except ValueError:
                return None
    return None


def error_of(code: grpc.StatusCode, message: str) -> errors.StoreError:
    """The typed error a client raises for a failed call."""
    cls = _ERRORS.get(code, errors.StoreError)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        cls = errors.Unavailable
    return cls(message)
