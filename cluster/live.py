"""Live figures for `vericache status`: every metrics endpoint the running service lists
in its state file, scraped with the deployment's metrics token and summarised per
component (one row per shard or decoder)."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from prefix_store.metrics import scrape
from prefix_store.tls import TLSClientConfig
from rpc.metrics import OK


def live_figures(state: dict, tls: TLSClientConfig | None = None) -> dict[str, dict]:
    """{component: figures} for each endpoint in `state` (a component that cannot be
    scraped gets {"error": why})."""
    token = state.get("metrics_token", "")
    out = {}
    for name, url in state.get("metrics", {}).items():
        try:
            out[name] = {"url": url, **summarise(scrape(url, token, timeout_s=3.0, tls=tls))}
        except (OSError, PermissionError) as error:
            out[name] = {"url": url, "error": str(error)}
    return out


def summarise(text: str) -> dict[str, float]:
    """The figures an operator reads first, from one exposition."""
    values: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            _add(values, sample.name, sample.labels, sample.value)
    return dict(values)


def _add(values: dict, name: str, labels: dict, value: float) -> None:
    component, _, metric = name.removeprefix("vericache_").partition("_")
    if component == "http":  # a router's OpenAI-compatible API (its calls counted as gRPC's too)
        if metric != "requests_total":
            return
        values["http_requests"] += value
        if not labels.get("status", "200").startswith("2"):
            values["http_errors"] += value
    elif metric == "requests_total":
        values["requests"] += value
        if labels.get("code", OK) != OK:
            values["errors"] += value
    elif metric in ("sent_bytes_total", "received_bytes_total"):
        values[metric.removesuffix("_total")] += value
    elif metric == "lookup_chunks_total":
        values[f"lookup_{labels['result']}s"] += value
    elif metric == "generated_tokens_total":
        values["tokens"] += value
    elif metric == "failovers_total":
        values["failovers"] += value
    elif metric == "audits_total":
        values[f"audits_{labels['result']}"] += value
    elif metric == "tier_bytes":
        values[f"{labels['tier']}_bytes"] = value
    elif metric in (
        "tokens_per_second",
        "kv_used_bytes",
        "kv_budget_bytes",
        "in_flight",
        "queued",
        "cached_prefixes",
        "connections",
        "data_plane_tickets",
        "leased_blobs",
        "evictions_total",
    ):
        values[metric.removesuffix("_total")] = value


def render(figures: dict[str, dict]) -> list[str]:
    """Lines of the live table."""
    if not figures:
        return ["live: no metrics endpoints listed (a service started with --no-metrics?)"]
    lines = ["live (from the metrics endpoints):"]
    for name, f in figures.items():
        if "error" in f:
            lines.append(f"  {name:<10} unreachable: {f['error']}")
        elif name.startswith("lmcache"):
            lines.append(
                f"  {name:<10} {f.get('requests', 0):>7.0f} LMCache requests  out "
                f"{_size(f.get('sent_bytes', 0))}  in {_size(f.get('received_bytes', 0))}  "
                f"connections {f.get('connections', 0):.0f}"
            )
        elif name.startswith("router"):
            http = (
                f"  HTTP {f['http_requests']:.0f} requests ({f.get('http_errors', 0):.0f} failed)"
                if "http_requests" in f
                else ""
            )
            lines.append(
                f"  {name:<10} {f.get('requests', 0):>7.0f} calls ({f.get('errors', 0):.0f} "
                f"failed)  {f.get('failovers', 0):.0f} moved to another decoder{http}"
            )
        elif name.startswith("decoder"):
            budget = _size(f.get("kv_budget_bytes", 0)) if f.get("kv_budget_bytes") else "unlimited"
            lines.append(
                f"  {name:<10} {f.get('tokens_per_second', 0):7.2f} tok/s  "
                f"{f.get('tokens', 0):>9.0f} tokens  {f.get('requests', 0):>6.0f} calls "
                f"({f.get('errors', 0):.0f} failed)  in flight {f.get('in_flight', 0):.0f}, "
                f"queued {f.get('queued', 0):.0f}  prefixes {f.get('cached_prefixes', 0):.0f}  "
                f"KV {_size(f.get('kv_used_bytes', 0))} of "
                f"{budget}  audits {f.get('audits_identical', 0):.0f} identical, "
                f"{f.get('audits_mismatch', 0):.0f} mismatched"
            )
        else:
            lookups = f.get("lookup_hits", 0) + f.get("lookup_misses", 0)
            rate = f"{f.get('lookup_hits', 0) / lookups:.0%}" if lookups else "-"
            lines.append(
                f"  {name:<10} {f.get('requests', 0):>7.0f} calls ({f.get('errors', 0):.0f} "
                f"failed)  out {_size(f.get('sent_bytes', 0))}  in "
                f"{_size(f.get('received_bytes', 0))}  hit rate {rate}  evictions "
                f"{f.get('evictions', 0):.0f}  leases {f.get('leased_blobs', 0):.0f}  tickets "
                f"{f.get('data_plane_tickets', 0):.0f}"
            )
    return lines


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
