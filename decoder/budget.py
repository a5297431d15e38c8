"""The decoder's KV byte budget (its "device memory", DESIGN.md section 4).

Everything the engine keeps for requests counts: resident compressed prefixes, resident
full prefixes (the full-KV baseline, and prefixes recomputed locally after a store
failure), tails, draft tails and staging buffers. The engine reserves a request's bytes
before admitting it and releases them when it finishes; shared objects (one prefix's
compressed or full copy, the staging ring) are charged once, while anyone uses them.
"""

from __future__ import annotations

import threading

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

    @property
    def free(self) -> int | None:
        return None if self.limit is None else self.limit - self.used

    def fits(self, nbytes: int) -> bool:
        with self._lock:
            return self.limit is None or self.used + nbytes <= self.limit

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve `nbytes` if they fit; False (nothing reserved) otherwise."""
        with self._lock:
            if self.limit is not None and self.used + nbytes > self.limit:
                return False
            self._take(nbytes)
            return True

    def reserve(self, nbytes: int) -> None:
        """Reserve unconditionally (growth of something already admitted)."""
        with self._lock:
            self._take(nbytes)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            if self.used < 0:
                raise RuntimeError(f"kv budget released {-self.used} bytes more than reserved")

    def _take(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)
