"""The scrubber: a background thread that re-reads every blob at rest, in both tiers, and
checks it against its stored CRC-32C, so that a corrupt replica is found and dropped
before a read meets it (replicas, or a recompute, then take over: the same as when a read
finds it). It reads at most `ShardConfig.scrub_rate` bytes per second, so that it never
competes with serving; a pass walks the blobs held when it starts, then the next begins.
"""

from __future__ import annotations

import logging
import threading
import time

from prefix_store.shard import Shard

log = logging.getLogger(__name__)
IDLE_S = 1.0
"""Pause between passes over an empty shard."""


class Scrubber:
    def __init__(self, shard: Shard, rate: float) -> None:
        if rate <= 0:
            raise ValueError("Scrubber: rate must be > 0 bytes per second")
        self.shard, self.rate = shard, rate
        self.passes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scrubber", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def scrub_pass(self) -> int:
        """Check every blob held now, at no more than `rate` bytes/s; returns the bytes
        checked (stops early, between blobs, when the scrubber is stopped)."""
        checked, start = 0, time.monotonic()
        for blob_id in self.shard.scrub_ids():
            if self._stop.is_set():
                break
            checked += self.shard.scrub(blob_id)
            ahead = checked / self.rate - (time.monotonic() - start)
            if ahead > 0 and self._stop.wait(ahead):
                break
        self.passes += 1
        return checked

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.scrub_pass() == 0:
                    self._stop.wait(IDLE_S)
            except Exception:  # noqa: BLE001 - a failed pass must not end scrubbing
                log.exception("shard %s: scrub pass failed", self.shard.config.shard_id)
                self._stop.wait(IDLE_S)
