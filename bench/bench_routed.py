"""Routed workload: requests through one router to 2 decoders, by prefix affinity vs round
robin.

Everything real, as `vericache serve` deploys it: Ray actors for 2 shards (replication 2),
2 decoders (one torch thread each: this machine has 2 cores, so the two decoders share
them; compare the policies' ratio, not scale-out) and 1 router, an embedded Redis. One
tenant publishes `--prefixes` (4) prefixes of real Python source (`--prefix-tokens` each,
with their compressed artifact) through the router, then sends `--requests` (8) requests
per prefix, all at once, each with its own question, `--max-new-tokens` each, in
`--mode` (vericache).

Per policy: aggregate tokens/s (all tokens over the batch's wall time), bytes the decoders
read from the store per generated token (pulled full KV plus near-data queries and
partials), the compressed copies the decoders hold at the end (one per prefix and decoder
that served it), requests per decoder, and identical-to-full-KV per request (against the
same prompt decoded in this process with full KV). Figures are medians over `--repeats`
(3) runs, each on a fresh deployment, with their range [min-max] in the table and JSON
(bench/stats.py); "identical" is the fewest of any run.

Usage: python bench/bench_routed.py [--prefixes 4] [--requests 8] [--prefix-tokens 1500]
       [--max-new-tokens 24] [--repeats 3] [--out bench/results/routed.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stats import DEFAULT_REPEATS, row_text, spreads, spreads_json  # noqa: E402
from cluster.serve import Deployment, ServeConfig  # noqa: E402
from decoder.generate import generate_full  # noqa: E402
from decoder.loader import load_model  # noqa: E402
from decoder.runner import ModelRunner  # noqa: E402
from decoder.service import DecoderClient  # noqa: E402
from prefix_store.config import GiB  # noqa: E402
from prefix_store.metadata import Metadata  # noqa: E402

POLICIES = ("affinity", "round-robin")
MODULES = ["argparse", "inspect", "difflib", "typing", "pathlib", "dataclasses"]
COMPRESSOR = "snapkv:budget=0.125"
TIMED = ("tok_s", "wall_s", "read_bytes_per_token")
"""The figures that vary from run to run: medians, with their spread."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8, help="per prefix")
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--mode", default="vericache")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--out", type=Path, default=Path("bench/results/routed.json"))
    return parser.parse_args(argv)


def workload(model, args) -> list[tuple[list[int], list[int]]]:
    """(prefix, prompt) per request: `requests` prompts over each of `prefixes` prefixes."""
    import importlib

    prefixes = []
    for name in MODULES[: args.prefixes]:
        text = inspect.getsource(importlib.import_module(name))
        prefixes.append(model.encode(text)[: args.prefix_tokens])
    out = []
    for p, prefix in enumerate(prefixes):
        for i in range(args.requests):
            question = model.encode(f"\n# Question {p}.{i}: what does line {7 * i + 3} do?\n")
            out.append((prefix, prefix + question[1:]))
    return out


def references(model, requests, args) -> list[list[int]]:
    runner = ModelRunner(model.config, model.weights)
    return [
        generate_full(
            runner, [prompt], max_new_tokens=args.max_new_tokens,
            eos_token_ids=model.eos_token_ids,
        )[0].tokens
        for _, prompt in requests
    ]  # fmt: skip


def run_policy(policy: str, requests, want, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="vericache-routed-") as home:
        os.environ["VERICACHE_HOME"] = home
        config = ServeConfig(
            shards=2,
            memory_bytes=2 * GiB,
            disk_bytes=0,
            state_dir=Path(home) / "state",
            decoders=2,
            decoder_threads=1,
            router_policy=policy,
        )
        with Deployment(config) as deployment:
            token = Metadata(deployment.redis_url).add_tenant("bench")
            router = deployment.routers[0]
            with DecoderClient(router, token, timeout_s=3600) as client:
                for prefix in {tuple(p): p for p, _ in requests}.values():
                    client.publish(token_ids=prefix, compressors=[COMPRESSOR])
            replies, wall = batch(router, token, requests, args)
            with DecoderClient(router, token) as client:
                copies = client.info().cached_prefixes
    tokens = sum(len(r.tokens) for r in replies)
    read = sum(r.stats.get("pulled_bytes", 0) + r.stats.get("near_bytes", 0) for r in replies)
    return {
        "policy": policy,
        "tok_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "read_bytes_per_token": read / max(1, tokens),
        "compressed_copies": copies,
        "per_decoder": dict(Counter(r.stats["worker"] for r in replies)),
        "identical": sum(r.tokens == w for r, w in zip(replies, want, strict=True)),
        "requests": len(replies),
        "failovers": sum(r.stats["router"]["failovers"] for r in replies),
    }


def batch(router: str, token: str, requests, args):
    """Every request at once, each on its own client; (replies in order, wall seconds)."""
    replies: list = [None] * len(requests)
    errors: list = []

    def one(i: int) -> None:
        try:
            with DecoderClient(router, token, timeout_s=3600) as client:
                replies[i] = client.generate(
                    token_ids=requests[i][1], max_new_tokens=args.max_new_tokens,
                    mode=args.mode, compressor=COMPRESSOR,
                )  # fmt: skip
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]!r}")
    return replies, wall


def median_row(runs: list[dict]) -> dict:
    """One policy's row over its runs: the first run's counts, the `TIMED` figures' medians
    (their spread under "spread"), the fewest identical requests of any run."""
    figures = spreads(runs, TIMED)
    row = dict(runs[0])
    row.update({key: figure.median for key, figure in figures.items()})
    row["spread"] = spreads_json(figures)
    row["identical"] = min(r["identical"] for r in runs)
    row["runs"] = len(runs)
    return row


def print_table(rows: list[dict]) -> None:
    base = next(r for r in rows if r["policy"] == "round-robin")
    print(f"medians of {base['runs']} runs, [min-max] of the runs")
    print("| policy | tok/s [min-max] | vs round robin | read/token | compressed copies "
          "| per decoder | identical |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        spread = ", ".join(f"{k} {v}" for k, v in sorted(r["per_decoder"].items()))
        print(
            f"| {r['policy']} | {row_text(r, 'tok_s')} | {r['tok_s'] / base['tok_s']:.2f}x | "
            f"{r['read_bytes_per_token'] / 1e6:.1f} MB | {r['compressed_copies']} | {spread} | "
            f"{r['identical']}/{r['requests']} |"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    model = load_model()
    requests = workload(model, args)
    print(f"routed: {len(requests)} requests over {args.prefixes} prefixes of "
          f"{args.prefix_tokens} tokens; references in process ...", flush=True)  # fmt: skip
    want = references(model, requests, args)
    rows = []
    for policy in POLICIES:
        runs = [run_policy(policy, requests, want, args) for _ in range(args.repeats)]
        rows.append(median_row(runs))
        print(f"  {policy}: {rows[-1]['tok_s']:.2f} tok/s", flush=True)
    print_table(rows)
    affinity, rr = rows
    result = {
        "workload": vars(args) | {"out": str(args.out)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows": rows,
        "affinity_over_round_robin": affinity["tok_s"] / rr["tok_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(r["identical"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
