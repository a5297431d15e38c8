"""What bulk reads from the shards achieve from here: the rate a pull of a prefix's bytes
gets, measured on reads large enough that one round trip is a small part of their time; and
the round trip itself, which bounds below what any exchange of several dependent calls costs.

A read of a few hundred KB (a prefix's partial last chunk) is almost all round-trip latency:
rated by its bytes per second it makes a pull of tens of MB look a hundred times slower than
it is. So reads under `BULK_BYTES` are not counted.
"""

from __future__ import annotations

import collections
import threading

BULK_BYTES = 1 << 20
"""Reads of fewer bytes say little of the link's rate (not counted)."""
KEPT = 8
"""Latest bulk reads the rate is taken over (a link that got faster or slower shows)."""


class LinkMeter:
    """The rate of the latest bulk reads, and the latest small calls' round trips.
    Thread-safe; one may serve every client of a process (the link is the same whatever
    the tenant: the figures say nothing of any)."""

    def __init__(self) -> None:
        self._reads: collections.deque[tuple[int, float]] = collections.deque(maxlen=KEPT)
        self._trips: collections.deque[float] = collections.deque(maxlen=KEPT)
        self._lock = threading.Lock()

    def record_round_trip(self, seconds: float) -> None:
        """A small call's whole time (a Describe: a round trip, plus the connection's
        set-up when it was a channel's first call)."""
        if seconds > 0:
            with self._lock:
                self._trips.append(seconds)

    @property
    def round_trip_s(self) -> float:
        """The least of the kept round trips (the set-up in a first call only adds to one);
        0.0 before any was recorded."""
        with self._lock:
            return min(self._trips, default=0.0)

    def record(self, nbytes: int, seconds: float) -> None:
        """A read of `nbytes` that took `seconds` (ignored under `BULK_BYTES`)."""
        if nbytes >= BULK_BYTES and seconds > 0:
            with self._lock:
                self._reads.append((nbytes, seconds))

    @property
    def bandwidth(self) -> float:
        """Bytes per second over the kept bulk reads; 0.0 before any was recorded."""
        with self._lock:
            nbytes = sum(n for n, _ in self._reads)
            seconds = sum(s for _, s in self._reads)
        return nbytes / seconds if seconds > 0 else 0.0
