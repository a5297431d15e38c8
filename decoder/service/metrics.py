"""A decoder worker's Prometheus metrics (`prefix_store.metrics` for the conventions).

Counted as requests end, from the stats each result already carries: tokens by mode and
tenant, verifications by drafts accepted, per-request mean draft-step and verification
latencies, bytes read from the store per token, and the shadow identity checks
(`decoder.service.audit`). Read at scrape time from the worker: KV budget and its use,
requests in flight and queued, cached prefixes, and tokens per second over the last
`RATE_WINDOW_S`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from decoder.horizon import REASONS
from prefix_store.metrics import TenantLabels
from rpc.metrics import RpcMetrics

PREFIX = "vericache_decoder"
RATE_WINDOW_S = 60.0
"""Tokens per second is measured over this window."""
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class TokenRate:
    """Tokens per second over the last `window_s` (a gauge; Prometheus users may prefer
    `rate(vericache_decoder_generated_tokens_total[1m])`)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self._lock:
            self._events.append((time.monotonic(), tokens))

    def per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            return sum(n for _, n in self._events) / self.window_s


class DecoderMetrics:
    """The registry of one decoder worker (its servicer and worker count into it)."""

    def __init__(self, worker, tenant_labels: int = 32) -> None:
        self.registry = CollectorRegistry()
        self.rpc = RpcMetrics(self.registry, "decoder")
        self.tenant = TenantLabels(tenant_labels)
        self.rate = TokenRate()
        r = self.registry
        self.tokens = Counter(
            f"{PREFIX}_generated_tokens_total",
            "Verified tokens streamed to callers, by mode and tenant.",
            ["mode", "tenant"],
            registry=r,
        )
        self.accepted = Histogram(
            f"{PREFIX}_accepted_per_verification",
            "Verifications (vericache mode) by the number of drafted tokens they accepted.",
            registry=r,
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
        )
        self.draft = Histogram(
            f"{PREFIX}_draft_step_seconds",
            "Mean draft-forward time of each finished vericache request.",
            registry=r,
            buckets=SECONDS,
        )
        self.verify = Histogram(
            f"{PREFIX}_verification_seconds",
            "Mean verification-pass time of each finished vericache request.",
            registry=r,
            buckets=SECONDS,
        )
        self.read_bytes = Counter(
            f"{PREFIX}_store_bytes_total",
            "Bytes exchanged with the store for exact passes: pulled full KV, or near-data "
            "queries and partials.",
            ["path"],
            registry=r,
        )
        self.near_retries = Counter(
            f"{PREFIX}_near_retries_total",
            "Exact passes undone while attending a prefix on the shards (a busy shard, or a "
            "failure the replicas could not cover) and redone with the prefix pulled, per "
            "request in the pass.",
            registry=r,
        )
        self.per_token = Histogram(
            f"{PREFIX}_pulled_bytes_per_token",
            "Full-KV bytes pulled per generated token, per finished request.",
            registry=r,
            buckets=(0, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9),
        )
        self.rounds = Counter(
            f"{PREFIX}_rounds_total",
            "Draft/verify rounds of finished vericache requests by why their horizon was "
            "chosen: fixed, start, draft (the cost model drafts), exact (it takes plain exact "
            "steps), probe (drafting again to measure it).",
            ["reason"],
            registry=r,
        )
        for reason in REASONS:
            self.rounds.labels(reason)
        self.audits = Counter(
            f"{PREFIX}_audits_total",
            "Shadow identity checks (--audit-rate): identical, mismatch, error, or skipped "
            "(the audit queue was full).",
            ["result"],
            registry=r,
        )
        for result in ("identical", "mismatch", "error", "skipped"):
            self.audits.labels(result)
        r.register(_WorkerCollector(worker, self.rate))

    def finished(self, tenant: str, stats: dict) -> None:
        """A request ended with `stats` (its result's stats)."""
        generated = int(stats.get("generated_tokens", 0))
        self.tokens.labels(str(stats.get("mode", "")), self.tenant(tenant)).inc(generated)
        self.rate.add(generated)
        pulled = float(stats.get("pulled_bytes", 0))
        self.read_bytes.labels("pull").inc(pulled)
        self.read_bytes.labels("near").inc(float(stats.get("near_bytes", 0)))
        self.near_retries.inc(int(stats.get("near_retries", 0)))
        if generated:
            self.per_token.observe(pulled / generated)
        for accepted, rounds in stats.get("accepted_histogram", {}).items():
            for _ in range(int(rounds)):
                self.accepted.observe(int(accepted))
        for reason, rounds in stats.get("policy", {}).items():
            if reason in REASONS:
                self.rounds.labels(reason).inc(int(rounds))
        if stats.get("draft_steps"):
            self.draft.observe(stats["draft_s"] / stats["draft_steps"])
        if stats.get("verifications"):
            self.verify.observe(stats["verify_s"] / stats["verifications"])


class _WorkerCollector(Collector):
    """Holds its worker weakly: the worker owns the registry, and a cycle through it would
    keep a closed worker's model alive until a full garbage collection."""

    def __init__(self, worker, rate: TokenRate) -> None:
        self.worker = weakref.ref(worker)
        self.rate = rate

    def collect(self):
        worker = self.worker()
        if worker is None:
            return
        info = worker.info()
        figures = (
            ("kv_budget_bytes", "KV budget of the worker (0: unlimited).", info.kv_budget),
            ("kv_used_bytes", "KV bytes held (prefixes, tails, staging, resident).", info.kv_used),
            ("kv_cached_bytes", "Of which idle cached prefixes' compressed KV.", info.kv_cached),
            ("in_flight", "Requests being decoded.", info.in_flight),
            ("queued", "Requests waiting for admission.", info.queued),
            ("cached_prefixes", "Prefixes the worker knows.", info.cached_prefixes),
            ("engines", "Engines (mode, compressor, n-gram) kept.", info.engines),
            ("weight_bytes", "Model weights held, every form once.", info.weight_bytes),
            ("peak_rss_bytes", "Peak resident memory of the process.", info.peak_rss_bytes),
            (
                "tokens_per_second",
                f"Tokens per second over {RATE_WINDOW_S:.0f} s.",
                self.rate.per_second(),
            ),  # fmt: skip
        )
        for name, doc, value in figures:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
