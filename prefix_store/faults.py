"""Fault injection for tests and chaos runs: bytes corrupted on their way out of a shard,
after every check the shard makes, as a bit flipped on the wire would be: fetched layers
and data-plane messages (`TRANSIT`), or near-data attention partials (`ATTEND`, apart so
that a fault can aim at near-data verification alone). Disarmed unless a test (or `make
chaos`, in the shard's process) arms it; disarmed it costs one comparison."""

from __future__ import annotations

import threading


class TransitFaults:
    """Flips one byte of each of the next `arm(n)` outgoing fetched layers or messages."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._left = 0
        self.fired = 0

    def arm(self, frames: int = 1) -> None:
        with self._lock:
            self._left = frames

    def disarm(self) -> None:
        self.arm(0)

    def tamper(self, buffers: list) -> list:
        """`buffers` as sent, or (when armed) a copy with one payload byte flipped."""
        if not self._left:
            return buffers
        with self._lock:
            if not self._left:
                return buffers
            self._left -= 1
            self.fired += 1
        out = list(buffers)
        for i, buffer in enumerate(out):
            view = memoryview(buffer).cast("B")
            if view.nbytes:
                flipped = bytearray(view)
                flipped[view.nbytes // 2] ^= 0x01
                out[i] = memoryview(bytes(flipped))
                break
        return out


TRANSIT = TransitFaults()
"""Fetched layers (gRPC Fetch and the data plane) and data-plane messages."""
ATTEND = TransitFaults()
"""Attend answers: one flipped byte in a query's partials (m, l, acc)."""
