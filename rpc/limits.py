"""Bounds on what callers hold on a server, for every server (shards, decoders, routers),
as configured by `prefix_store.limits.CallBounds`.

`CallLimits` divides a server's call slots among the tenants calling it by fair share
(`prefix_store.shares.FairShare`: weighted, a newcomer's room always kept free), under an
absolute per-tenant cap, with a small pool reserved for the admin role; so that no tenant
(nor two, nor a crowd of idle streams) can take every server thread: a call over its share
fails at once with RESOURCE_EXHAUSTED naming the limit, before it reads its request.
Health checks and reflection never take a slot (they are not tenants' calls: the server's
threads beyond `total + reserved` serve them). `IdleStreams` cuts a
client stream that sends nothing for too long (it would hold its thread forever)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator

from prefix_store.errors import LimitExceeded
from prefix_store.limits import CallBounds
from prefix_store.shares import FairShare, Reserved


class CallLimits:
    """A server's call slots: the admin role's reserved pool first, then the tenants' fair
    share. Thread-safe."""

    def __init__(self, bounds: CallBounds) -> None:
        self.bounds = bounds
        self.shares = FairShare(bounds.total, "calls in flight", limit=bounds.per_tenant)
        self.reserved = Reserved(bounds.reserved, "admin call slots")

    @contextlib.contextmanager
    def admit(self, tenant: str, weight: float = 1.0, admin: bool = False) -> Iterator[None]:
        """Hold one of `tenant`'s call slots for the block; LimitExceeded naming the share
        or the limit when it may take none. An `admin` caller takes a reserved slot when
        one is free, else a share like any tenant."""
        if admin and self.reserved.try_acquire():
            try:
                yield
            finally:
                self.reserved.release()
            return
        with self.shares.hold(tenant, 1, weight):
            yield

    def in_flight(self, tenant: str | None = None) -> int:
        if tenant is None:
            return self.shares.held() + self.reserved.held()
        return self.shares.held(tenant)


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
                del message  # not kept while the next one is awaited (it may be large)
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
