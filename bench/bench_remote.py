"""Remote prefix caching: full-KV baseline vs lossy vs VeriCache over the prefix store.

Everything real: the store runs as Ray actors (2 shards, replication 2) with a Redis
metadata plane; a decoder worker serves gRPC on loopback; requests go through the SDK
client, concurrently, each with a tenant token. Every mode uses the same decoder (same
model, same KV budget accounting) and the same store.

Workloads (prefixes are real Python source, published once with their compressed artifact):
- shared: one `--shared-tokens` (8000: 8K within the model's 8192-token context) prefix,
  `--shared-requests` (16) requests with different suffixes, `--max-new-tokens` (128) each.
  The full-KV baseline pulls the prefix once and keeps that copy resident, shared by all
  requests (as prefix-caching engines do); VeriCache keeps the compressed copy and pulls
  the full one for each verification.
- distinct: `--distinct-requests` (8) requests, each with its own `--distinct-tokens` (4K)
  prefix, under the KV budgets at which the full-KV baseline holds 2, 4 and all 8 requests
  at once; VeriCache runs under the same budgets.

- routed: `bench/bench_routed.py` (2 decoders behind a router, 4 shared prefixes x 8
  requests, prefix affinity vs round robin), written to `<out>-routed.json`.

Modes: `full` (the strongest full-KV engine we have: one resident copy per prefix, shared
by its requests), `full+ngram` (the same with prompt-lookup guesses verified in its exact
passes: lossless, no compression), `lossy` (compressed decoding, not lossless),
`vericache`, and `vericache+ngram` (the drafter also checks prompt-lookup guesses). A mode
may name the placement of its decoder's verification passes (DESIGN.md section 4), which
then holds for every pass (no resident copies): `vericache@pull` pulls the prefix's full KV,
`vericache@near` attends it on the shards that hold it (near-data attention). Plain
`vericache` is the service's default: resident copies while the budget has room, else
`auto`.

Columns: aggregate tokens/s (all generated tokens over the batch's wall time) and its ratio
to the full-KV baseline of the same workload and budget; p50/p95 request latency; accepted
tokens per verification; bytes on the wire per generated token (the full KV pulled plus,
near-data, queries and partials); the near-data passes' time per pass waiting on the shards
("wire", round trips and shard compute) and the shards' compute within it; peak decoder KV
bytes (budget accounting); the DESIGN.md section 10 bound (full-KV step time over draft
step time, measured in the same run, times the fraction of drafted tokens accepted); and
identical-to-full per request ("reference" on the full row, never compared with itself).
Figures are medians over `--repeats` (3) runs, each on a fresh decoder; the table gives the
range of tok/s over the runs ("min-max") and the JSON every figure's under "spread"
(bench/stats.py).

Besides the JSON it draws, beside it (bench/plots.py): `remote-budget.png` (tok/s vs KV
budget per mode), `remote-bytes.png` (bytes on the wire per token per mode) and
`remote-accepted.png` (accepted drafts per verification).

Usage: python bench/bench_remote.py [--workloads shared distinct] [--repeats 3]
       [--out bench/results/remote.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import plots  # noqa: E402
from bench.stats import DEFAULT_REPEATS, row_spread, spreads, spreads_json  # noqa: E402
from cluster.serve import Deployment, ServeConfig  # noqa: E402
from decoder.loader import load_model  # noqa: E402
from decoder.progress import note, progress  # noqa: E402
from decoder.service import DecoderClient, DecoderConfig, DecoderServer  # noqa: E402
from prefix_store.config import GiB  # noqa: E402
from prefix_store.metadata import Metadata  # noqa: E402

MODULES = [
    "argparse",
    "inspect",
    "difflib",
    "typing",
    "pathlib",
    "dataclasses",
    "enum",
    "functools",
    "textwrap",
    "json.decoder",
    "collections",
    "logging",
]


def source_text(start: int) -> str:
    import importlib

    parts = []
    for name in MODULES[start:] + MODULES[:start]:
        parts.append(inspect.getsource(importlib.import_module(name)))
    return "\n\n".join(parts)


def suffix(model, i: int) -> list[int]:
    return model.encode(f"\n\n# Task {i}: explain the code above, part {i}, step by step.\n#")[1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--workloads",
        nargs="+",
        choices=("shared", "distinct", "routed"),
        default=["shared", "distinct", "routed"],
        help="routed: 2 decoders behind a router, affinity vs round robin (bench_routed.py)",
    )
    # 8K: as long as the built-in model's 8192-token context leaves room for suffix and output
    ap.add_argument("--shared-tokens", type=int, default=8000)
    ap.add_argument("--shared-requests", type=int, default=16)
    ap.add_argument("--distinct-tokens", type=int, default=4096)
    ap.add_argument("--distinct-requests", type=int, default=8)
    ap.add_argument("--holds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--compressor", default="snapkv:budget=0.125")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=[
            "full",
            "full+ngram",
            "lossy",
            "vericache@pull",
            "vericache@near",
            "vericache+ngram",
        ],
    )
    ap.add_argument("--ngram", type=int, default=8, help="guesses per forward in +ngram modes")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--out", type=Path, default=Path("bench/results/remote.json"))
    args = ap.parse_args()

    status = 0
    if "routed" in args.workloads:
        from bench import bench_routed

        routed = args.out.with_name(f"{args.out.stem}-routed.json")
        status = bench_routed.main(["--repeats", str(args.repeats), "--out", str(routed)])
        if set(args.workloads) == {"routed"}:
            return status
    model = load_model()
    limit = model.config.max_position_embeddings
    longest = max(args.shared_tokens, args.distinct_tokens) + 32 + args.max_new_tokens
    if longest > limit:
        ap.error(f"prefix + suffix + new tokens ({longest}) exceeds the context of {limit}")
    home = Path(tempfile.mkdtemp(prefix="vericache-bench-"))
    os.environ["VERICACHE_HOME"] = str(home)
    serve = ServeConfig(
        shards=2, decoders=0, memory_bytes=4 * GiB, disk_bytes=0, state_dir=home / "state"
    )
    rows = []
    with Deployment(serve) as deployment:
        stores = tuple(deployment.endpoints[i] for i in sorted(deployment.endpoints))
        token = Metadata(deployment.redis_url).add_tenant("bench", 0)
        key = deployment.signer.private_bytes
        publisher = _server(stores, None, model, key)
        try:
            workloads = {}
            if "shared" in args.workloads:
                prefix = model.encode(source_text(0))[: args.shared_tokens]
                _publish(publisher, token, [prefix], args.compressor)
                workloads["shared"] = [
                    prefix + suffix(model, i) for i in range(args.shared_requests)
                ]
            if "distinct" in args.workloads:
                prefixes = [
                    model.encode(source_text(i))[: args.distinct_tokens]
                    for i in range(args.distinct_requests)
                ]
                _publish(publisher, token, prefixes, args.compressor)
                workloads["distinct"] = [p + suffix(model, i) for i, p in enumerate(prefixes)]
        finally:
            publisher.stop()
        sweep = {name: _budgets(name, prompts, model, args) for name, prompts in workloads.items()}
        runs = sum(len(budgets) for budgets in sweep.values()) * len(args.modes)
        with progress(desc="bench_remote", total=runs, unit="run") as bar:
            for name, prompts in workloads.items():
                for budget, label in sweep[name]:
                    reference = None
                    for mode in args.modes:
                        bar.set_postfix_str(f"{name} {label} {mode}")
                        row = _measure(stores, token, model, prompts, mode, budget, args, key)
                        row.update(workload=name, budget=budget, budget_label=label)
                        if mode == "full":
                            reference = row
                        _finish_row(row, reference)
                        rows.append(row)
                        _print_row(row)
                        bar.update(1)
    _print_table(rows)
    write_results(args, model, rows=rows)
    plots.write_figures(
        args.out,
        [
            ("budget", plots.budget_sweep, rows),
            ("bytes", plots.bytes_per_token, rows),
            ("accepted", plots.accepted_histogram, rows),
        ],
    )
    return status


def _budgets(name: str, prompts, model, args) -> list[tuple[int | None, str]]:
    """(KV budget, label) to run a workload under: the distinct one under the budgets at
    which the full-KV baseline holds each of `--holds` requests, the shared one unlimited."""
    if name != "distinct":
        return [(None, "unlimited")]
    per_request = _full_request_bytes(model, len(prompts[0]), args)
    return [(h * per_request, f"full holds {h}") for h in args.holds]


def write_results(args, model, **results) -> None:
    """`results` under `args.out` as JSON, with the model, machine and arguments."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": model.name,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.write_text(json.dumps({"meta": meta, **results}, indent=2))
    print(f"\nwrote {args.out}")


def _server(stores, budget, model, key: bytes | None = None, mode: str = "") -> DecoderServer:
    """A decoder on the store; `key`: the deployment's provenance key, without which the
    shards refuse what it publishes (and it trusts only KV it published itself). A mode
    naming a placement (`vericache@near`) gets that placement and no resident copies."""
    placement = mode.partition("@")[2]
    config = DecoderConfig(
        store_endpoints=stores,
        kv_budget=budget,
        worker_id="bench",
        provenance_key=key,
        placement=placement or "auto",
        resident_prefixes=not placement,
    )
    server = DecoderServer(config, worker=None if model is None else _worker(config, model))
    server.start()
    return server


def _worker(config, model):
    from decoder.service.worker import DecoderWorker

    return DecoderWorker(config, model)


def _publish(server: DecoderServer, token: str, prefixes, compressor: str) -> None:
    with (
        DecoderClient(server.address, token) as client,
        progress(desc="publish", total=sum(map(len, prefixes)), unit="tok") as bar,
    ):
        for i, ids in enumerate(prefixes):
            t0 = time.perf_counter()
            reply = client.publish(token_ids=ids, compressors=[compressor])
            bar.update(len(ids))
            note(
                f"published prefix {i + 1}/{len(prefixes)}: {reply.tokens} tokens "
                f"({time.perf_counter() - t0:.0f}s)"
            )


def _full_request_bytes(model, prompt_tokens: int, args) -> int:
    """KV bytes one full-KV baseline request holds: its resident prefix (with tail room)
    and its own tail, as the engine charges them (multiples of 256-token chunks)."""
    c = model.config
    per_token = c.num_layers * (2 * c.num_kv_heads * c.head_dim * 4 + 8)
    tail = prompt_tokens - args.distinct_tokens + args.max_new_tokens + 32 + 1
    resident = -(-(args.distinct_tokens + tail) // 256) * 256
    own = -(-tail // 256) * 256
    return (resident + own) * per_token


def _measure(stores, token, model, prompts, mode, budget, args, key=None) -> dict:
    runs = []
    for _ in range(args.repeats):
        server = _server(stores, budget, model, key, mode)
        try:
            runs.append(_batch(server, token, prompts, mode, args))
        finally:
            server.stop()
    tokens = runs[0]["tokens"]
    if any(r["tokens"] != tokens for r in runs):
        raise SystemExit(f"{mode}: outputs differ across repeats")
    counts = ("tokens", "accepted_histogram", "policy")
    figures = spreads(runs, [key for key in runs[0] if key not in counts])
    row = {key: figure.median for key, figure in figures.items()}
    row["spread"] = spreads_json(figures)
    row["runs"] = len(runs)
    row["tokens"] = tokens
    row["accepted_histogram"] = plots.merged_histogram(r["accepted_histogram"] for r in runs)
    row["policy"] = _summed(r["policy"] for r in runs)
    row["mode"] = mode
    return row


def _batch(server: DecoderServer, token: str, prompts, mode: str, args) -> dict:
    replies: list = [None] * len(prompts)
    latencies = [0.0] * len(prompts)
    errors: list[BaseException] = []

    engine_mode, _, ngram = mode.partition("@")[0].partition("+")

    def one(i: int) -> None:
        t = time.perf_counter()
        try:
            with DecoderClient(server.address, token) as client:
                replies[i] = client.generate(
                    token_ids=prompts[i],
                    max_new_tokens=args.max_new_tokens,
                    mode=engine_mode,
                    compressor=args.compressor,
                    ngram=args.ngram if ngram else 0,
                )
        except BaseException as error:  # reported below
            errors.append(error)
        latencies[i] = time.perf_counter() - t

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    worker = server.worker
    timers = {k: 0.0 for k in ("draft_s", "draft_steps", "full_s", "full_steps")}
    for engine in worker.engines.engines():
        for key in timers:
            timers[key] += getattr(engine.stats, key)
    generated = sum(len(r.tokens) for r in replies)
    verifications = sum(r.stats.get("verifications", 0) for r in replies)
    return {
        "tokens": [r.tokens for r in replies],
        "accepted_histogram": plots.merged_histogram(
            r.stats.get("accepted_histogram", {}) for r in replies
        ),
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "p50_s": statistics.median(latencies),
        "p95_s": sorted(latencies)[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
        "accepted_per_verification": (
            sum(r.stats.get("accepted", 0) for r in replies) / verifications
            if verifications
            else 0.0
        ),
        "acceptance": (
            sum(r.stats.get("accepted", 0) for r in replies)
            / max(1, sum(r.stats.get("drafted", 0) for r in replies))
        ),
        "drafts_per_draft_step": (
            sum(r.stats.get("drafted", 0) for r in replies)
            / max(1, sum(r.stats.get("draft_steps", 0) for r in replies))
        ),
        "pulled_per_token": sum(r.stats.get("pulled_bytes", 0) for r in replies) / generated,
        "wire_per_token": sum(
            r.stats.get("pulled_bytes", 0) + r.stats.get("near_bytes", 0) for r in replies
        )
        / generated,
        "near_passes": sum(r.stats.get("near_passes", 0) for r in replies),
        "policy": _policy(replies),
        **{key: statistics.median(r.stats[key] for r in replies) for key in PHASES},
        "near_wire_per_pass_s": _per_pass(replies, "near_wire_s"),
        "near_shard_per_pass_s": _per_pass(replies, "near_shard_s"),
        "peak_kv_bytes": worker.budget.peak,
        "full_step_s": timers["full_s"] / timers["full_steps"] if timers["full_steps"] else 0.0,
        "draft_step_s": timers["draft_s"] / timers["draft_steps"] if timers["draft_steps"] else 0.0,
        "fetch_stall_s": max((r.stats.get("fetch_stall_s", 0.0) for r in replies), default=0.0),
        "fetch_s": max((r.stats.get("fetch_s", 0.0) for r in replies), default=0.0),
    }


PHASES = ("queue_s", "prefill_s", "decode_s")
"""A request's time waiting for admission, prefilling its suffix and decoding (medians over
the batch's requests): where a mode's latency goes."""


def _policy(replies) -> dict[str, int]:
    """Rounds by the horizon policy's reason (`decoder.horizon.REASONS`), over all requests."""
    return _summed(reply.stats.get("policy", {}) for reply in replies)


def _summed(counts) -> dict[str, int]:
    """Dicts of counts, summed key by key."""
    total: dict[str, int] = {}
    for count in counts:
        for key, n in count.items():
            total[key] = total.get(key, 0) + n
    return dict(sorted(total.items()))


def _per_pass(replies, key: str) -> float:
    """Seconds of `key` per near-data pass (0 without such passes)."""
    passes = sum(r.stats.get("near_passes", 0) for r in replies)
    return sum(r.stats.get(key, 0.0) for r in replies) / passes if passes else 0.0


def _finish_row(row: dict, reference: dict | None) -> None:
    """Compare `row` with the full-KV `reference` row of its workload and budget (None when
    no full mode ran): its tok/s ratio, how many requests' tokens equal the reference's
    ("7/8") and, for vericache modes, the DESIGN.md section 10 bound. The reference itself
    is never compared with itself: its "identical" is None (`identical_cell`: "reference")."""
    if reference is None:
        row.update(ratio=None, identical=None, bound=None)
        return
    row["ratio"] = row["tokens_per_s"] / reference["tokens_per_s"]
    row["bound"] = None
    if row is reference:
        row["identical"] = None
        return
    same = [a == b for a, b in zip(row["tokens"], reference["tokens"], strict=True)]
    row["identical"] = f"{sum(same)}/{len(same)}"
    if row["mode"].startswith("vericache") and row["draft_step_s"] and reference["full_step_s"]:
        # a draft forward gives `drafts_per_draft_step` drafts (more than one with n-gram)
        per_draft_s = row["draft_step_s"] / max(1.0, row["drafts_per_draft_step"])
        row["bound"] = reference["full_step_s"] / per_draft_s * row["acceptance"]
        row["share_of_bound"] = row["ratio"] / row["bound"]


HEADER = (
    f"{'workload':9s} {'budget':>15s} {'mode':15s} {'tok/s':>7s} {'min-max':>13s} "
    f"{'vs full':>7s} {'p50 s':>6s} {'p95 s':>6s} {'acc/ver':>7s} {'dr/fwd':>6s} "
    f"{'wire/tok':>10s} {'wire ms':>7s} {'shard ms':>8s} {'peak KV':>9s} {'bound':>6s} "
    f"{'of bnd':>6s} identical"
)


def _fmt_row(row: dict) -> str:
    ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
    bound = f"{row['bound']:.2f}x" if row.get("bound") else "-"
    speculative = row["mode"].startswith("vericache")
    acc = f"{row['accepted_per_verification']:.2f}" if speculative else "-"
    per_fwd = f"{row['drafts_per_draft_step']:.2f}" if speculative else "-"
    share = f"{row['share_of_bound']:.2f}" if row.get("share_of_bound") else "-"
    near = row.get("near_passes")
    wire = f"{1e3 * row['near_wire_per_pass_s']:.0f}" if near else "-"
    shard = f"{1e3 * row['near_shard_per_pass_s']:.0f}" if near else "-"
    return (
        f"{row['workload']:9s} {row['budget_label']:>15s} {row['mode']:15s} "
        f"{row['tokens_per_s']:7.2f} {tokens_per_s_range(row):>13s} {ratio:>7s} "
        f"{row['p50_s']:6.1f} {row['p95_s']:6.1f} {acc:>7s} {per_fwd:>6s} "
        f"{_mb(row['wire_per_token']):>10s} {wire:>7s} {shard:>8s} "
        f"{_mb(row['peak_kv_bytes']):>9s} {bound:>6s} {share:>6s} {identical_cell(row)}"
    )


def identical_cell(row: dict) -> str:
    """A row's identical-to-full cell: "reference" for the full-KV row, which is never
    compared with itself; else how many requests equal it ("7/8"), "-" when no full mode ran."""
    if row["mode"] == "full":
        return "reference"
    return row["identical"] or "-"


def tokens_per_s_range(row: dict) -> str:
    """A row's tokens/s over its runs as "min-max"."""
    return row_spread(row, "tokens_per_s").range_text()


def _print_row(row: dict) -> None:
    note(_fmt_row(row))


def _print_table(rows: list[dict]) -> None:
    runs = sorted({row["runs"] for row in rows})
    print(f"\nmedians of {'/'.join(map(str, runs))} runs; min-max: tok/s over the runs")
    print(HEADER)
    print("-" * len(HEADER))
    for row in rows:
        print(_fmt_row(row))


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}MB" if n >= 1e5 else f"{n / 1e3:.1f}KB"


if __name__ == "__main__":
    sys.exit(main())
