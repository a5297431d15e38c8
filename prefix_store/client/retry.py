"""The client's one retry policy: retry on UNAVAILABLE (quarantining the target), and on a
refusal its server marked busy (`status.RETRY_AFTER` on gRPC; on the data plane, its in-band
refusal, `LimitExceeded`, for puts: no quarantine, waiting at least what it asked), with
capped exponential backoff, moving through the candidate targets; every
other status becomes a typed error at once.
`Attempts` is the policy without I/O; `retrying` and `retrying_async` only call and sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

import grpc

from prefix_store.config import ClientConfig
from prefix_store.errors import LimitExceeded, StoreError, Unavailable
from prefix_store.status import BUSY_RETRY_MS, RETRYABLE, busy_retry_s, error_of

T = TypeVar("T")


def backoff(config: ClientConfig, attempt: int) -> float:
    return min(config.max_backoff_s, config.backoff_s * (2**attempt))


def rpc_error(error: grpc.RpcError) -> StoreError:
    """The store's typed error for a failed call. A refusal marked `retry-after-ms` is
    `LimitExceeded` (the server's bounds: try again later or elsewhere), never
    `QuotaExceeded`, which is the tenant's stored bytes and does not pass with time."""
    if busy_retry_s(error) is not None:
        return LimitExceeded(error.details() or "refused over the server's limits")
    return error_of(error.code(), error.details() or str(error.code()))


def stopping(error: grpc.RpcError, target: str, method: str) -> Unavailable | None:
    """UNAVAILABLE for a call its shard cancelled (it is stopping: as for a shard that is
    down, the caller tries again or elsewhere); None for any other failure."""
    if error.code() != grpc.StatusCode.CANCELLED:
        return None
    return Unavailable(f"{target} cancelled {method} (it is stopping)")


def busy_wait_s(error: BaseException) -> float | None:
    """Seconds to wait after a refusal by a shard's bounds (gRPC RESOURCE_EXHAUSTED marked
    `retry-after-ms`, or the data plane's in-band refusal, `LimitExceeded`) before trying
    it again or a replica; None for any other failure."""
    if isinstance(error, grpc.RpcError):
        return busy_retry_s(error)
    if isinstance(error, LimitExceeded):
        return BUSY_RETRY_MS / 1000
    return None


def retryable(error: grpc.RpcError | Unavailable) -> StoreError:
    """The error as a typed one if retrying may help; raises it at once otherwise."""
    if isinstance(error, Unavailable):
        return error
    if error.code() in RETRYABLE:
        return rpc_error(error)
    raise rpc_error(error) from error


class Attempts:
    """One call's attempts: `config.retries` of them over `targets` in turn. `on_unavailable`
    hears of each target that failed UNAVAILABLE (the client quarantines it)."""

    def __init__(
        self,
        config: ClientConfig,
        targets: Sequence[str],
        on_unavailable: Callable[[str], None] | None = None,
        wait_when_busy: bool = False,
    ) -> None:
        self.config, self.targets, self.on_unavailable = config, list(targets), on_unavailable
        self.wait_when_busy = wait_when_busy
        """Whether a data-plane busy refusal (`LimitExceeded`) is tried again after its wait
        (puts), rather than raised at once (fetches: the caller moves to a replica)."""
        self.attempt = 0
        self.last: StoreError | None = None
        self.busy = False
        """Whether the last failure was a busy server's refusal."""

    def __iter__(self) -> Iterator[str]:
        for attempt in range(self.config.retries):
            self.attempt = attempt
            yield self.targets[attempt % len(self.targets)]

    def failed(self, target: str, error: grpc.RpcError | Unavailable | LimitExceeded) -> float:
        """Seconds to wait before the next attempt; raises the typed error at once if no
        retry can help (a data-plane busy refusal too, unless `wait_when_busy`)."""
        if isinstance(error, LimitExceeded) and not self.wait_when_busy:
            raise error
        wait = busy_wait_s(error)
        self.busy = wait is not None
        if isinstance(error, LimitExceeded):
            self.last = error
        else:
            self.last = rpc_error(error) if self.busy else retryable(error)
        if not self.busy and self.on_unavailable is not None:
            self.on_unavailable(target)
        if self.attempt + 1 >= self.config.retries:
            return 0
        return max(backoff(self.config, self.attempt), wait or 0.0)

    def exhausted(self) -> StoreError:
        if self.busy and self.last is not None:
            return self.last  # still busy: its RESOURCE_EXHAUSTED, not UNAVAILABLE
        return Unavailable(
            f"{len(self.targets)} shard(s) unavailable after {self.config.retries} attempts: "
            f"{self.last}"
        )


def retrying(attempts: Attempts, call: Callable[[str], T]) -> T:
    """`call(target)` on the targets in turn until one answers; UNAVAILABLE moves on, a busy
    refusal waits first (see `Attempts.failed`)."""
    for target in attempts:
        try:
            return call(target)
        except (grpc.RpcError, Unavailable, LimitExceeded) as error:
            time.sleep(attempts.failed(target, error))
    raise attempts.exhausted()


async def retrying_async(attempts: Attempts, call: Callable[[str], Awaitable[T]]) -> T:
    """`retrying` for coroutines."""
    for target in attempts:
        try:
            return await call(target)
        except (grpc.RpcError, Unavailable, LimitExceeded) as error:
            await asyncio.sleep(attempts.failed(target, error))
    raise attempts.exhausted()
