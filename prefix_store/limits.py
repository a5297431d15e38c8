"""Bounds on what callers hold on a server, shared by the store's and the decoder's.

`CallLimits` caps concurrent calls per tenant and in all, so that one tenant (or a crowd
of idle streams) cannot take every server thread: a call over a limit fails at once with
RESOURCE_EXHAUSTED naming the limit, before it reads its request. `IdleStreams` cuts a
client stream that sends nothing for too long (it would hold its thread forever)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from prefix_store.errors import LimitExceeded


@dataclass(frozen=True, slots=True)
class CallBounds:
    """What a server lets its callers hold at once."""

    per_tenant: int = 16
    """Concurrent calls of one tenant."""
    total: int = 28
    """Concurrent calls of all tenants: keep it below the server's threads, so that health
    checks and reflection always find one."""
    stream_idle_s: float = 30.0
    """A client stream that sends no message for this long is cancelled."""

    def __post_init__(self) -> None:
        if not 1 <= self.per_tenant <= self.total:
            raise ValueError("CallBounds: need 1 <= per_tenant <= total")
        if self.stream_idle_s <= 0:
            raise ValueError("CallBounds.stream_idle_s must be > 0")


class CallLimits:
    def __init__(self, bounds: CallBounds) -> None:
        self.bounds = bounds
        self._lock = threading.Lock()
        self._calls: Counter = Counter()

    @contextlib.contextmanager
    def admit(self, tenant: str) -> Iterator[None]:
        """Hold one of `tenant`'s call slots for the block; LimitExceeded when none is free."""
        with self._lock:
            if self._calls[tenant] >= self.bounds.per_tenant:
                raise LimitExceeded(
                    f"tenant {tenant!r}: {self._calls[tenant]} calls in flight "
                    f"(per-tenant limit {self.bounds.per_tenant}); retry when one ends"
                )
            if sum(self._calls.values()) >= self.bounds.total:
                raise LimitExceeded(
                    f"server busy: {self.bounds.total} calls in flight (limit); retry shortly"
                )
            self._calls[tenant] += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls[tenant] -= 1
                if self._calls[tenant] <= 0:
                    del self._calls[tenant]

    def in_flight(self, tenant: str | None = None) -> int:
        with self._lock:
            return self._calls[tenant] if tenant is not None else sum(self._calls.values())


class TenantSlots:
    """At most `limit` concurrent holders of one kind (`what`, e.g. "Attend streams") per
    tenant; one over it fails at once with LimitExceeded naming the limit."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what = limit, what
        self._lock = threading.Lock()
        self._held: Counter = Counter()

    @contextlib.contextmanager
    def admit(self, tenant: str) -> Iterator[None]:
        with self._lock:
            if self._held[tenant] >= self.limit:
                raise LimitExceeded(
                    f"tenant {tenant!r}: {self._held[tenant]} {self.what} open "
                    f"(per-tenant limit {self.limit}); retry when one ends"
                )
            self._held[tenant] += 1
        try:
            yield
        finally:
            with self._lock:
                self._held[tenant] -= 1
                if self._held[tenant] <= 0:
                    del self._held[tenant]


class IdleStreams:
    """Cancels client streams whose next message is overdue (one watchdog thread)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._deadlines: dict[object, float] = {}
        self._thread: threading.Thread | None = None

    def watch(self, context, messages: Iterator) -> Iterator:
        """`messages` of the call `context`; the call is cancelled when one is overdue."""
        self._start()
        try:
            while True:
                with self._lock:
                    self._deadlines[context] = time.monotonic() + self.idle_s
                try:
                    message = next(messages)
                except StopIteration:
                    return
                with self._lock:
                    self._deadlines.pop(context, None)
                yield message
        finally:
            with self._lock:
                self._deadlines.pop(context, None)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="idle-streams", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.idle_s / 4))
            now = time.monotonic()
            with self._lock:
                overdue = [c for c, deadline in self._deadlines.items() if deadline < now]
                for context in overdue:
                    del self._deadlines[context]
            for context in overdue:
                context.cancel()
