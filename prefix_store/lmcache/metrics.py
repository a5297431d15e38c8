"""The gateway's Prometheus metrics (`prefix_store.metrics` for the conventions), read at
scrape time from its `GatewayStats`: LMCache commands by result, bytes in and out, and
connections."""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "vericache_gateway"
EVENTS = {
    "puts": ("put", "stored"),
    "get_hits": ("get", "hit"),
    "get_misses": ("get", "miss"),
    "exist_hits": ("exist", "hit"),
    "exist_misses": ("exist", "miss"),
    "protocol_errors": ("frame", "protocol_error"),
    "connections": ("connect", "accepted"),
    "connections_refused": ("connect", "refused"),
}
"""Stats events as (command, result); "put_refused:QuotaExceeded"-like events are (put,
QuotaExceeded): the store's error classes, a finite set."""


def registry(gateway) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_GatewayCollector(gateway))
    return registry


class _GatewayCollector(Collector):
    """Holds its gateway weakly (the gateway owns the registry: no cycle)."""

    def __init__(self, gateway) -> None:
        self._gateway = weakref.ref(gateway)

    def collect(self):
        gateway = self._gateway()
        if gateway is None:
            return
        counts = gateway.stats.snapshot()
        requests = CounterMetricFamily(
            f"{PREFIX}_requests",
            "LMCache requests and connections, by command and result.",
            labels=["command", "result"],
        )
        for event, n in sorted(counts.items()):
            if event in EVENTS:
                requests.add_metric(list(EVENTS[event]), n)
            elif ":" in event:  # put_refused:QuotaExceeded, get_failed:Unavailable
                what, _, reason = event.partition(":")
                requests.add_metric([what.partition("_")[0], reason], n)
        yield requests
        for name, key, doc in (
            ("received_bytes", "bytes_in", "Object bytes received in PUTs."),
            ("sent_bytes", "bytes_out", "Object bytes sent in GET replies."),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=counts.get(key, 0))
        yield GaugeMetricFamily(
            f"{PREFIX}_connections", "LMCache connections open.", value=gateway.connections()
        )
