"""The client's one retry policy: retry only on UNAVAILABLE, with capped exponential backoff,
moving through the candidate shards; every other status becomes a typed error at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from prefix_store.config import ClientConfig
from prefix_store.errors import StoreError, Unavailable
from prefix_store.status import RETRYABLE, error_of

T = TypeVar("T")


def backoff(config: ClientConfig, attempt: int) -> float:
    return min(config.max_backoff_s, config.backoff_s * (2**attempt))


def rpc_error(error: grpc.RpcError) -> StoreError:
    return error_of(error.code(), error.details() or str(error.code()))


def retryable(error: grpc.RpcError | Unavailable) -> StoreError:
    """The error as a typed one if retrying may help; raises it at once otherwise."""
    if isinstance(error, Unavailable):
        return error
    if error.code() in RETRYABLE:
        return rpc_error(error)
    raise rpc_error(error) from error


def retrying(config: ClientConfig, targets: Sequence[str], call: Callable[[str], T]) -> T:
    """`call(target)` on the targets in turn until one answers; UNAVAILABLE moves on."""
    last: StoreError | None = None
    for attempt in range(config.retries):
        target = targets[attempt % len(targets)]
        try:
            return call(target)
        except (grpc.RpcError, Unavailable) as error:
            last = retryable(error)
            time.sleep(backoff(config, attempt))
    raise Unavailable(
        f"{len(targets)} shard(s) unavailable after {config.retries} attempts: {last}"
    )


async def retrying_async(
    config: ClientConfig, targets: Sequence[str], call: Callable[[str], Awaitable[T]]
) -> T:
    last: StoreError | None = None
    for attempt in range(config.retries):
        target = targets[attempt % len(targets)]
        try:
            return await call(target)
        except (grpc.RpcError, Unavailable) as error:
            last = retryable(error)
            await asyncio.sleep(backoff(config, attempt))
    raise Unavailable(
        f"{len(targets)} shard(s) unavailable after {config.retries} attempts: {last}"
    )
