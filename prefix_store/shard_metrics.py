"""A shard's Prometheus metrics (`prefix_store.metrics` for the conventions).

Counted as they happen: RPCs by method and status code, and lookups per tenant (chunks hit
and missed). Read at scrape time from what the shard already keeps (`shard_stats`, the
data plane's load, per-tenant usage): tiers, chunks, leases, tickets, bytes in and out,
evictions and faults, so that no figure is kept twice.
"""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prefix_store.metrics import TenantLabels
from rpc.metrics import RpcMetrics

PREFIX = "vericache_store"


class ShardMetrics:
    """The registry of one shard (its servicer counts into it; `ShardServer` serves it)."""

    def __init__(self, servicer, tenant_labels: int = 32) -> None:
        self.registry = CollectorRegistry()
        self.rpc = RpcMetrics(self.registry, "store")
        self.tenant = TenantLabels(tenant_labels)
        self.lookups = Counter(
            f"{PREFIX}_lookup_chunks_total",
            "Chunks asked for by Lookup, by tenant and result (hit, miss).",
            ["tenant", "result"],
            registry=self.registry,
        )
        self.registry.register(_ShardCollector(servicer, self.tenant))

    def looked_up(self, tenant: str, hits: int, misses: int) -> None:
        label = self.tenant(tenant)
        self.lookups.labels(label, "hit").inc(hits)
        self.lookups.labels(label, "miss").inc(misses)


class _ShardCollector(Collector):
    """Holds its servicer weakly (the servicer owns the registry: no cycle)."""

    def __init__(self, servicer, tenant: TenantLabels) -> None:
        self._servicer = weakref.ref(servicer)
        self.tenant = tenant

    @property
    def servicer(self):
        return self._servicer()

    def collect(self):
        if self.servicer is None:
            return
        stats = self.servicer.shard_stats()
        yield from self._tiers(stats)
        yield from self._counters(stats)
        yield _gauge("chunks", "Full-KV chunks held.", stats["chunks"])
        yield _gauge("artifacts", "Compressed artifacts held.", stats["artifacts"])
        yield _gauge("leased_blobs", "Blobs leased by open reads.", stats["leased_chunks"])
        tickets, connections = (0, 0)
        if self.servicer.data_plane is not None:
            tickets, connections = self.servicer.data_plane.load()
        yield _gauge("data_plane_tickets", "Data-plane tickets not yet redeemed.", tickets)
        yield _gauge("data_plane_connections", "Data-plane connections open.", connections)
        usage = GaugeMetricFamily(
            f"{PREFIX}_tenant_bytes",
            "Bytes a tenant's data holds on this shard.",
            labels=["tenant"],
        )
        totals: dict[str, int] = {}
        for tenant, nbytes in self.servicer.shard.usage().items():
            label = self.tenant(tenant)
            totals[label] = totals.get(label, 0) + nbytes
        for label, nbytes in sorted(totals.items()):
            usage.add_metric([label], nbytes)
        yield usage

    @staticmethod
    def _tiers(stats: dict):
        used = GaugeMetricFamily(f"{PREFIX}_tier_bytes", "Bytes held per tier.", labels=["tier"])
        capacity = GaugeMetricFamily(
            f"{PREFIX}_tier_capacity_bytes", "Capacity per tier.", labels=["tier"]
        )
        for tier in ("memory", "disk"):
            used.add_metric([tier], stats[f"{tier}_bytes"])
            capacity.add_metric([tier], stats[f"{tier}_capacity"])
        yield used
        yield capacity

    @staticmethod
    def _counters(stats: dict):
        sent = CounterMetricFamily(
            f"{PREFIX}_sent_bytes", "Payload bytes sent, by path.", labels=["path"]
        )
        sent.add_metric(["fetch"], stats["fetched_bytes"])
        sent.add_metric(["attend"], stats["attend_bytes_out"])
        yield sent
        received = CounterMetricFamily(
            f"{PREFIX}_received_bytes", "Payload bytes received, by path.", labels=["path"]
        )
        received.add_metric(["put"], stats["received_bytes"])
        received.add_metric(["attend"], stats["attend_bytes_in"])
        yield received
        yield _counter("stored_bytes", "Bytes of puts new to this shard.", stats["stored_bytes"])
        yield _counter("evictions", "Blobs evicted from the memory tier.", stats["evictions"])
        yield _counter("dropped", "Blobs evicted out of the shard (no tier had room).",
                       stats["dropped"])  # fmt: skip
        faults = CounterMetricFamily(
            f"{PREFIX}_faults", "Faults survived, by kind.", labels=["kind"]
        )
        for kind in ("corrupt", "lost_spills", "disk_write_errors"):
            faults.add_metric([kind], stats[kind])
        yield faults
        yield _counter("scrub_corrupt", "Corrupt blobs the scrubber found at rest, dropped "
                       "(also in faults{kind=corrupt}).", stats["scrub_corrupt"])  # fmt: skip
        yield _counter("scrubbed_bytes", "Bytes at rest the scrubber re-checked.",
                       stats["scrubbed_bytes"])  # fmt: skip
        yield _counter("attend_queries", "Near-data attention queries answered.",
                       stats["attend_queries"])  # fmt: skip
        yield _counter("attend_compute_seconds", "Shard time computing attention partials.",
                       stats["attend_compute_s"])  # fmt: skip


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
