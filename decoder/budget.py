"""The decoder's KV byte budget (its "device memory", DESIGN.md section 4).

Everything the engine keeps for requests counts: resident compressed prefixes, resident
full prefixes (the full-KV baseline, and prefixes recomputed locally after a store
failure), tails, draft tails and staging buffers. The engine reserves a request's bytes
before admitting it and releases them when it finishes; shared objects (one prefix's
compressed or full copy, the staging ring) are charged once, while anyone uses them.

Some bytes are held only because there was room: full prefixes kept resident by VeriCache
engines (DESIGN.md section 4). Their holders register a reclaimer; a reservation that does
not fit asks the reclaimers to give such bytes back (one resident copy per call) until it
fits or none is left, so that room taken opportunistically never keeps a request of any
engine sharing the budget waiting. Reclaimers run in the reserving thread: on a decoder
worker every reservation happens on its one scheduler thread, which also steps the engines.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from decoder.errors import OverBudget

__all__ = ["KVBudget", "OverBudget"]


class KVBudget:
    """A byte counter with a limit (None: unlimited). Thread-safe."""

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and limit <= 0:
            raise ValueError(f"kv budget must be > 0 bytes, got {limit}")
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._reclaimers: list[Callable[[], bool]] = []

    def add_reclaimer(self, reclaim: Callable[[], bool]) -> None:
        """`reclaim()` releases some opportunistically held bytes; False when it has none."""
        self._reclaimers.append(reclaim)

    @property
    def free(self) -> int | None:
        return None if self.limit is None else self.limit - self.used

    def fits(self, nbytes: int) -> bool:
        with self._lock:
            return self.limit is None or self.used + nbytes <= self.limit

    def try_reserve(self, nbytes: int, reclaim: bool = True) -> bool:
        """Reserve `nbytes` if they fit, reclaiming opportunistic holdings if needed (unless
        `reclaim` is False); False (nothing reserved) otherwise."""
        while True:
            with self._lock:
                if self.limit is None or self.used + nbytes <= self.limit:
                    self._take(nbytes)
                    return True
            if not (reclaim and self._reclaim_one()):
                return False

    def reserve(self, nbytes: int) -> None:
        """Reserve unconditionally (growth of something already admitted); opportunistic
        holdings are reclaimed while the budget is over its limit."""
        with self._lock:
            self._take(nbytes)
        while self.limit is not None and self.used > self.limit and self._reclaim_one():
            pass

    def _reclaim_one(self) -> bool:
        return any(reclaim() for reclaim in list(self._reclaimers))

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            if self.used < 0:
                raise RuntimeError(f"kv budget released {-self.used} bytes more than reserved")

    def _take(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)
