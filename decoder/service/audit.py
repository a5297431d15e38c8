"""The shadow identity check: a sample of finished requests is decoded again with the full
KV, off the hot path, and compared token for token with what the caller was sent.

VeriCache's outputs are full-KV outputs by construction (every token is verified); the
audit lets operators watch that hold in production. A sampled request (`rate`, default 0:
off) is queued after its caller got its last token; one background thread replays it in
`full` mode through the same worker (the same scheduler, so it takes turns with live
requests instead of preempting them), with the caller's token (so it reads exactly what
the request could read) and the seed the request used. The result is counted in
`vericache_decoder_audits_total{result}`; a mismatch is logged with the request id and the
first position that differs (never the tokens or the prompt). The queue is bounded: a
sample that finds it full is counted as skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """A finished request to check: what it was asked (`spec`, with a concrete seed) and
    what its caller received."""

    request_id: str
    token: str = dataclasses.field(repr=False)
    spec: object
    """A `GenerateSpec` (mode and n-gram as served; the reference decodes it in full mode)."""
    tokens: tuple[int, ...]


class Auditor:
    """Replays sampled requests with `reference(sample) -> token ids` and compares."""

    def __init__(
        self,
        rate: float,
        reference: Callable[[Sample], list[int]],
        count: Callable[[str], None],
        queue_size: int = 4,
        rng: random.Random | None = None,
    ) -> None:
        """count(result): one of identical, mismatch, error, skipped."""
        self.rate = rate
        self.reference = reference
        self.count = count
        self.tamper: Callable[[list[int]], list[int]] | None = None
        """Test hook: applied to each reference output before the comparison (a test makes
        a deliberate mismatch with it; production leaves it None)."""
        self._rng = rng or random.Random()
        self._queue: queue.Queue[Sample | None] = queue.Queue(queue_size)
        self._idle = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None

    def sampled(self) -> bool:
        """Whether the next finished request is to be audited."""
        return self.rate > 0 and self._rng.random() < self.rate

    def offer(self, sample: Sample) -> None:
        """Queue a sampled request (never blocks; counts `skipped` when the queue is full)."""
        with self._idle:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="audit", daemon=True)
                self._thread.start()
            try:
                self._queue.put_nowait(sample)
            except queue.Full:
                self.count("skipped")
                return
            self._pending += 1

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every queued sample is checked (tests, shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)

    def _loop(self) -> None:
        while (sample := self._queue.get()) is not None:
            try:
                self.count(self._check(sample))
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _check(self, sample: Sample) -> str:
        try:
            expected = list(self.reference(sample))
        except Exception as error:  # noqa: BLE001 - an audit never fails anything else
            log.warning("audit of request %s could not run: %s", sample.request_id, error)
            return "error"
        if self.tamper is not None:
            expected = self.tamper(expected)
        got = list(sample.tokens)
        if got == expected:
            return "identical"
        at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
        at = min(len(got), len(expected)) if at is None else at
        log.error(
            "audit: request %s differs from full-KV decoding at token %d (%d tokens sent, "
            "%d expected)",
            sample.request_id,
            at,
            len(got),
            len(expected),
        )
        return "mismatch"
