"""Every gRPC service's calls, counted by method and final status (`RpcMetrics`), as its
handlers (`rpc.handler`) count them; names follow `prefix_store.metrics`' conventions."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

OK = "OK"
"""The `code` label of a call that succeeded (others: the gRPC status code's name)."""


class RpcMetrics:
    """Calls of one gRPC service by method and final status, and their durations."""

    def __init__(self, registry: CollectorRegistry, component: str) -> None:
        self.calls = Counter(
            f"vericache_{component}_requests_total",
            "RPCs served, by method and final status code (OK or the gRPC code's name).",
            ["method", "code"],
            registry=registry,
        )
        self.seconds = Histogram(
            f"vericache_{component}_request_seconds",
            "Wall time of RPCs (streams: until their last message), by method.",
            ["method"],
            registry=registry,
            buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60, 300),
        )

    @contextmanager
    def call(self, method: str, code_of) -> Iterator[None]:
        """Counts the block as one call of `method`: OK, or `code_of(error)` for the error
        it raises (re-raised). A generator that is closed early counts as CANCELLED."""
        start = time.perf_counter()
        code = OK
        try:
            yield
        except GeneratorExit:
            code = grpc.StatusCode.CANCELLED.name
            raise
        except BaseException as error:
            code = code_of(error).name
            raise
        finally:
            self.calls.labels(method, code).inc()
            self.seconds.labels(method).observe(time.perf_counter() - start)
