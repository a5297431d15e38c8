"""Remote prefix caching with the store on other hosts, behind shaped links.

Real hosts on this machine (cluster/testbed.py: network namespaces with their own
addresses, SSH servers, processes and files): `head` (Ray head, Redis) and `storage1`,
`storage2` (one store shard each, replication 2), set up with `ray up` of
cluster/local.yaml and `vericache serve --detach --decoders 0` as an operator would.
The decoder worker runs in this process, on this machine, outside the storage hosts: every
byte it pulls crosses its own link to them (a veth pair onto the hosts' bridge), limited
with a `tc` token bucket in both directions to each `--links` speed in turn (1.2 GB/s: the
paper's remote-storage bandwidth; 1 Gbit/s; 100 Mbit/s). The storage hosts' own links are
not limited: the decoder's link to remote storage is the bottleneck being emulated.

Workloads (bench_remote's, real Python source): `shared`, one `--shared-tokens` prefix and
`--requests` concurrent requests with different suffixes; `distinct`, `--distinct-requests`
requests each over its own `--distinct-tokens` prefix. `--max-new-tokens` each. Modes
(bench_remote's): the full-KV baseline (pulls each prefix once and keeps it resident),
`vericache` (the service default: resident copies while the budget has room, here
unlimited), and the placements held for every pass without resident copies:
`vericache@pull` (the prefix's full KV pulled per pass, layer by layer into the staging
ring, the first layers while drafting) and `vericache@near` (near-data attention: per layer
the pass's query rows go to the shards, chunk partials come back). On links below 1 Gbit/s
only `--slow-modes` run (pulling a prefix per pass there takes tens of seconds a pass).

Columns: aggregate tokens/s and its ratio to the baseline on the same link; p50/p95
latency; accepted tokens per verification; bytes on the wire per generated token (pulled
KV, plus near-data queries and partials); the near-data passes' wait per pass and the
shards' compute within it; for pulls, the time pulling, the time passes stalled on it and
"hidden": the share of pull time passes did not wait for (1 - stall / pull time). A raw
fetch of the whole prefix KV measures each shaped link first (the median of three, with
their range). Figures are medians over `--repeats` (3) runs; the table gives the range of
tok/s over the runs ("min-max") and the JSON every figure's under "spread"
(bench/stats.py).

Besides the JSON it draws, beside it (bench/plots.py): `cluster-links.png` (tok/s vs the
baseline against link speed, per mode), `cluster-bytes.png` (bytes on the wire per token)
and `cluster-accepted.png` (accepted drafts per verification).

Needs root (namespaces, tc). Usage: python bench/bench_cluster.py [--repeats 3]
       [--links 1.2GB/s 1Gbit/s] [--out bench/results/cluster.json]
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_remote import (  # noqa: E402
    _finish_row,
    _measure,
    _publish,
    _server,
    identical_cell,
    source_text,
    suffix,
    tokens_per_s_range,
    write_results,
)

from bench import plots  # noqa: E402
from bench.stats import DEFAULT_REPEATS, row_text, spread  # noqa: E402
from cluster.testbed import LocalCluster, Testbed, TestbedConfig  # noqa: E402
from decoder.loader import default_cache_dir, load_model  # noqa: E402
from decoder.progress import note, progress  # noqa: E402
from decoder.store_source import kv_layout  # noqa: E402
from prefix_store.client import StoreClient  # noqa: E402

LINKS = {"1.2GB/s": 1.2e9, "1Gbit/s": 125e6, "100Mbit/s": 12.5e6, "unshaped": None}
"""Link speeds in bytes/s (None: no limit, the bridge as fast as this machine moves it)."""
SERVE = (
    "vericache serve --address auto --detach --host 0.0.0.0 --shards 2 --decoders 0 "
    "--port 7000 --data-port 7100 --redis-port 6380 --memory-bytes 4GiB --disk-bytes 0"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--links", nargs="+", default=["1.2GB/s", "1Gbit/s", "100Mbit/s"], choices=list(LINKS)
    )
    ap.add_argument("--workloads", nargs="+", default=["distinct", "shared"])
    ap.add_argument("--shared-tokens", type=int, default=8000)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--distinct-tokens", type=int, default=4096)
    ap.add_argument("--distinct-requests", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--compressor", default="snapkv:budget=0.125")
    ap.add_argument(
        "--modes", nargs="+", default=["full", "vericache", "vericache@pull", "vericache@near"]
    )
    ap.add_argument("--slow-modes", nargs="+", default=["full", "vericache", "vericache@near"])
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/cluster.json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("needs root: the hosts are network namespaces and the links are shaped with tc")
    model = load_model()
    if args.shared_tokens + 32 + args.max_new_tokens > model.config.max_position_embeddings:
        ap.error("prefix + suffix + new tokens exceed the model's context")

    hosts = ("head", "storage1", "storage2")
    bed_config = TestbedConfig(hosts=hosts, carry=(ROOT, default_cache_dir()), shm_bytes=4 << 30)
    rows, probes = [], []
    with Testbed(bed_config) as bed:
        cluster = LocalCluster(bed, ROOT, head="head", storage=["storage1", "storage2"],
                               object_store_bytes=500_000_000)  # fmt: skip
        try:
            t0 = time.perf_counter()
            cluster.up()
            out = cluster.exec(SERVE)
            stores = tuple(re.findall(r"store\s+(\S+:\d+)", out))
            print(f"cluster up with shards at {', '.join(stores)} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)  # fmt: skip
            token = cluster.exec("vericache tenant add bench").split()[-1]
            key = deployment_key(cluster)
            workloads = publish(stores, token, model, args, key)
            bar = progress(desc="bench_cluster", total=runs(args), unit="run")
            for link in args.links:
                bed.shape(LINKS[link])  # the decoder's link to the store
                probes.append(probe(stores, token, model, workloads["probe"], link))
                for name in args.workloads:
                    reference = None
                    for mode in modes_on(link, args):
                        bar.set_postfix_str(f"{link} {name} {mode}")
                        prompts = workloads[name]
                        row = _measure(stores, token, model, prompts, mode, None, args, key)
                        row.update(link=link, link_bytes_per_s=LINKS[link], workload=name)
                        reference = row if mode == "full" else reference
                        _finish_row(row, reference)
                        add_pull_columns(row)
                        rows.append(row)
                        note(fmt_row(row))
                        bar.update(1)
            bar.close()
        finally:
            bed.shape(None)
            cluster.down()
    print_tables(probes, rows)
    write_results(args, model, links=probes, rows=rows)
    plots.write_figures(
        args.out,
        [
            ("links", plots.link_sweep, rows),
            ("bytes", plots.bytes_per_token, rows),
            ("accepted", plots.accepted_histogram, rows),
        ],
    )
    return 0


def modes_on(link: str, args) -> list[str]:
    """The modes run over a link: `--slow-modes` below 1 Gbit/s, else `--modes`."""
    slow = LINKS[link] is not None and LINKS[link] < 125e6
    return args.slow_modes if slow else args.modes


def runs(args) -> int:
    """Measurements in the whole sweep (what the progress bar counts)."""
    return sum(len(modes_on(link, args)) for link in args.links) * len(args.workloads)


def deployment_key(cluster) -> bytes:
    """The deployment's provenance key from the head host's state directory: the decoders
    this bench runs sign what they publish with it, and the shards accept and serve that
    KV as the model's own (without it every prefix would be recomputed locally)."""
    path = '"${VERICACHE_HOME:-$HOME/.vericache}/state/provenance.key"'
    return base64.b64decode(cluster.exec(f"base64 -w0 {path}").split()[-1])


def publish(stores, token, model, args, key: bytes) -> dict[str, list]:
    """Publish the workloads' prefixes (with their compressed artifacts); their prompts by
    workload, and under "probe" the longest prefix (what the link probe fetches)."""
    shared = model.encode(source_text(0))[: args.shared_tokens]
    distinct = [
        model.encode(source_text(i + 1))[: args.distinct_tokens]
        for i in range(args.distinct_requests)
    ]
    publisher = _server(stores, None, model, key)
    try:
        _publish(publisher, token, [shared, *distinct], args.compressor)
    finally:
        publisher.stop()
    return {
        "shared": [shared + suffix(model, i) for i in range(args.requests)],
        "distinct": [p + suffix(model, i) for i, p in enumerate(distinct)],
        "probe": shared,
    }


def probe(stores, token, model, prefix, link: str) -> dict:
    """A raw fetch of the whole prefix KV from both shards over the shaped link (the
    median of three, their range under "spread")."""
    import torch

    c = model.config
    layout = kv_layout(c, model.fingerprint)  # as the decoder stores it
    with StoreClient(list(stores), token) as client:
        cached = client.lookup(prefix, layout)
        k = torch.empty(c.num_layers, c.num_kv_heads, cached.tokens, c.head_dim)
        v = torch.empty_like(k)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            nbytes = client.fetch_layers(cached, k, v)
            times.append(time.perf_counter() - t)
    rate = spread(nbytes / s / 1e9 for s in times)
    seconds = sorted(times)[1]
    found = {"link": link, "bytes": nbytes, "seconds": seconds, "gb_per_s": rate.median,
             "spread": {"gb_per_s": rate.to_json()}}  # fmt: skip
    note(f"{link}: whole-prefix fetch {nbytes / 1e6:.0f} MB in {seconds:.2f}s = "
         f"{rate.text()} GB/s")  # fmt: skip
    return found


def add_pull_columns(row: dict) -> None:
    """Pull rate while pulling and the share of pull time hidden from verification."""
    fetch_s, stall_s = row.get("fetch_s", 0.0), row.get("fetch_stall_s", 0.0)
    row["hidden"] = max(0.0, 1 - stall_s / fetch_s) if fetch_s > 0 else None
    row["stall_s"] = stall_s


HEADER = (
    f"{'link':9s} {'workload':8s} {'mode':14s} {'tok/s':>7s} {'min-max':>13s} {'vs full':>7s} "
    f"{'p50 s':>6s} {'p95 s':>6s} {'acc/ver':>7s} {'wire/tok':>9s} {'wire ms':>7s} "
    f"{'shard ms':>8s} {'pull s':>7s} {'stall s':>7s} {'hidden':>6s} identical"
)


def fmt_row(row: dict) -> str:
    ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
    vericache = row["mode"].startswith("vericache")
    pulls = vericache and row["fetch_s"] > 0
    near = row.get("near_passes", 0) > 0
    acc = f"{row['accepted_per_verification']:.2f}" if vericache else "-"
    hidden = f"{row['hidden']:.0%}" if pulls and row["hidden"] is not None else "-"
    pull = f"{row['fetch_s']:7.1f}" if pulls else f"{'-':>7s}"
    stall = f"{row['stall_s']:7.1f}" if pulls else f"{'-':>7s}"
    wire_ms = f"{1e3 * row['near_wire_per_pass_s']:.0f}" if near else "-"
    shard_ms = f"{1e3 * row['near_shard_per_pass_s']:.0f}" if near else "-"
    wire = row["wire_per_token"]
    wire_text = f"{wire / 1e6:.1f}MB" if wire >= 1e5 else f"{wire / 1e3:.1f}KB"
    return (
        f"{row['link']:9s} {row['workload']:8s} {row['mode']:14s} {row['tokens_per_s']:7.2f} "
        f"{tokens_per_s_range(row):>13s} {ratio:>7s} {row['p50_s']:6.1f} {row['p95_s']:6.1f} "
        f"{acc:>7s} {wire_text:>9s} {wire_ms:>7s} {shard_ms:>8s} {pull} {stall} {hidden:>6s} "
        f"{identical_cell(row)}"
    )


def print_tables(probes: list[dict], rows: list[dict]) -> None:
    print("\nlink      whole-prefix fetch (median of 3 [min-max])")
    for p in probes:
        print(f"{p['link']:9s} {p['bytes'] / 1e6:.0f} MB in {p['seconds']:.2f}s = "
              f"{row_text(p, 'gb_per_s')} GB/s")  # fmt: skip
    runs = sorted({row["runs"] for row in rows})
    print(f"\nmedians of {'/'.join(map(str, runs))} runs; min-max: tok/s over the runs")
    print(HEADER)
    print("-" * len(HEADER))
    for row in rows:
        print(fmt_row(row))


if __name__ == "__main__":
    sys.exit(main())
