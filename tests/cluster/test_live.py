"""`vericache status`'s live table from real expositions (prometheus_client's own text)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from cluster.live import render, summarise
from rpc.metrics import RpcMetrics


def test_a_routers_http_requests_are_counted_not_their_timestamps():
    registry = CollectorRegistry()
    rpc = RpcMetrics(registry, "router")
    rpc.calls.labels("Generate", "OK").inc(4)
    http = Counter("vericache_http_requests_total", "HTTP", ["endpoint", "status"],
                   registry=registry)  # fmt: skip
    http.labels("chat", "200").inc(2)
    http.labels("chat", "401").inc()
    figures = summarise(generate_latest(registry).decode())
    assert (figures["http_requests"], figures["http_errors"]) == (3, 1)
    assert figures["requests"] == 4  # the `_created` samples count nowhere
    line = render({"router-0": figures})[1]
    assert "4 calls (0 failed)" in line and "HTTP 3 requests (1 failed)" in line
