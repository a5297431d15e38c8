"""Deadlines and minimum rates of put streams (Put, PutArtifact, data-plane puts).

A put holds a call slot, a thread and part of its tenant's quota while its bytes arrive,
so none may last for ever: every put stream has an absolute deadline fixed at its header
(`PutBounds.deadline`), and after a grace period its payload must keep arriving at a
minimum average rate. Messages that carry no payload (empty segment batches, unknown
fields) count for nothing, so they do not keep a stream alive. A stream that breaks either
rule is cut with DEADLINE_EXCEEDED naming the rule; its reservation is returned and nothing
of it is stored.

`Pace` is the rule for one stream, checked as its payload arrives (`arrived`); `Pacer` is a
watchdog thread that cuts gRPC streams whose next payload is overdue while their handler
waits for a message (a silent stream is never checked by `arrived`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from prefix_store.errors import DeadlineExceeded

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PutBounds:
    """How long a put stream may take (gRPC Put and PutArtifact, data-plane puts)."""

    grace_s: float = 10.0
    """For this long after its header a put may send at any rate..."""
    min_rate: float = 1 << 20
    """...then its payload (segment or artifact bytes) must have arrived at this many bytes
    per second on average since the grace ended; a slower put is cut (DEADLINE_EXCEEDED)."""
    deadline_s: float = 60.0
    """Every put ends within this long plus its declared bytes at `min_rate` after its header
    (so a put keeping the minimum rate always finishes before it), or is cut."""

    def __post_init__(self) -> None:
        if self.grace_s < 0 or self.min_rate <= 0:
            raise ValueError("PutBounds: grace_s must be >= 0 and min_rate > 0")
        if self.deadline_s <= self.grace_s:
            raise ValueError("PutBounds: deadline_s must exceed grace_s")

    def deadline(self, declared: int) -> float:
        """Seconds a put of `declared` bytes may take at most."""
        return self.deadline_s + declared / self.min_rate


class Pace:
    """The rule for one put stream of `declared` bytes (`what` names it in errors)."""

    def __init__(self, bounds: PutBounds, declared: int, what: str = "put") -> None:
        self.bounds, self.what = bounds, what
        self.start = time.monotonic()
        self.limit = bounds.deadline(declared)
        self.deadline = self.start + self.limit
        self.received = 0

    def declare(self, declared: int) -> None:
        """The stream's size is now known (its header came): its deadline follows it."""
        self.limit = self.bounds.deadline(declared)
        self.deadline = self.start + self.limit

    def arrived(self, nbytes: int) -> None:
        """Count `nbytes` of payload, then check the rules (DeadlineExceeded if broken)."""
        self.received += nbytes
        self.check()

    def due(self) -> float:
        """When the stream breaks a rule unless more payload arrives (monotonic time)."""
        starved = self.start + self.bounds.grace_s + self.received / self.bounds.min_rate
        return min(self.deadline, starved)

    def broken(self, now: float | None = None) -> str | None:
        """Why the stream is to be cut now, or None."""
        now = time.monotonic() if now is None else now
        elapsed = now - self.start
        if now > self.deadline:
            return (
                f"{self.what}: past its deadline of {self.limit:.1f} s (deadline_s "
                f"{self.bounds.deadline_s:g} + its declared bytes at min_rate "
                f"{self.bounds.min_rate:g} bytes/s); nothing was stored"
            )
        if now > self.start + self.bounds.grace_s + self.received / self.bounds.min_rate:
            return (
                f"{self.what}: {self.received} bytes in {elapsed:.1f} s is below the minimum "
                f"rate of {self.bounds.min_rate:g} bytes/s after a grace of "
                f"{self.bounds.grace_s:g} s; nothing was stored"
            )
        return None

    def check(self) -> None:
        reason = self.broken()
        if reason is not None:
            raise DeadlineExceeded(reason)


def cut(context, reason: str) -> None:
    """End a gRPC call from outside its handler with DEADLINE_EXCEEDED and `reason` (the
    handler's next read fails); a plain cancel (CANCELLED) where that is not possible."""
    inner = getattr(context, "context", context)  # the servicer's `Call` wraps it
    try:
        from grpc._cython import cygrpc

        inner._rpc_event.call.cancel(cygrpc.StatusCode.deadline_exceeded, reason)
    except Exception:  # noqa: BLE001 - another gRPC build: cancel without the reason
        log.debug("cutting a stream without its reason", exc_info=True)
        inner.cancel()


class Pacer:
    """Cuts gRPC put streams whose handler waits for a message past their `Pace.due`."""

    def __init__(self, tick_s: float = 0.1) -> None:
        self.tick_s = tick_s
        self._lock = threading.Lock()
        self._watched: dict[object, Pace] = {}
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, context: grpc.ServicerContext, pace: Pace) -> Iterator[Pace]:
        """Watch the call `context` under `pace` for the block."""
        with self._lock:
            self._watched[context] = pace
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="put-pacer", daemon=True)
                self._thread.start()
        try:
            yield pace
        finally:
            with self._lock:
                self._watched.pop(context, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.tick_s)
            now = time.monotonic()
            with self._lock:
                overdue = [(c, p) for c, p in self._watched.items() if p.due() < now]
                for context, _ in overdue:
                    del self._watched[context]
            for context, pace in overdue:
                reason = pace.broken(now)
                if reason is not None:
                    log.info("put stream cut: %s", reason)
                    cut(context, reason)
