"""Lossless decoding with the full KV in host memory: full-KV vs lossy vs VeriCache.

Workload: a long real Python source file (the standard library's argparse). For each
context C, the first C - 64 tokens are one shared prefix, prefilled once in exact mode and
held in host memory; each request adds its own 64-token suffix (another window of the same
file) and generates `--max-new-tokens` tokens greedily. Batch 1 uses the first suffix,
batch 8 eight different ones. Every mode runs on the same runner and the same requests:

- full: the prefix KV made resident, exact decoding (the reference);
- full+ngram: the same with prompt-lookup guesses verified by the exact pass (lossless,
  no compression: what n-gram speculation alone buys);
- lossy, per compressor: decoding with the compressed prefix alone;
- vericache, per compressor: draft with the compressed prefix, verify with the full one
  (automatic horizon; SnapKV 12.5%, else the first compressor, also at each fixed
  `--horizons`);
- vericache+ngram, per compressor: the drafter also checks prompt-lookup guesses, several
  drafts per draft forward (`--ngram` guesses at most).

Times are medians over `--repeats` runs; tokens must agree across repeats. "tok/s" counts
generated tokens over compression + suffix prefill + decoding (the shared prefix prefill
is the same for every mode and reported separately). The draft-step speedup is the full
mode's step time over the lossy mode's step time (same compressor, same batch), and the
bound is that speedup times the fraction of drafted tokens accepted (DESIGN.md section 10).

Besides the JSON it draws `local-horizon.png` (tok/s vs horizon) and `local-accepted.png`
(accepted drafts per verification) beside it (bench/plots.py).

Usage: python bench/bench_local.py [--contexts 2048 8192] [--batches 1 8]
       [--max-new-tokens 128] [--repeats 3] [--compressors SPEC ...] [--ngram 8]
       [--horizons 8 16 32] [--out bench/results/local.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import plots  # noqa: E402
from bench.stats import spread, spreads_json  # noqa: E402
from decoder.engine import Engine, EngineConfig, Request, prefill_prefix  # noqa: E402
from decoder.loader import load_model  # noqa: E402
from decoder.progress import note, progress  # noqa: E402
from decoder.runner import ModelRunner  # noqa: E402

COMPRESSORS = [
    "streamingllm:budget=0.125",
    "snapkv:budget=0.125",
    "h2o:budget=0.125",
    "pyramidkv:budget=0.125",
    "kivi:bits=2",
    "kivi:bits=4",
    "kivi:bits=8",
    "snapkv:budget=0.25+kivi:bits=4",
]
HORIZON_SPEC = "snapkv:budget=0.125"
"""The compressor also run at each fixed `--horizons` (else the first one given)."""
SUFFIX = 64


def source_tokens(model) -> list[int]:
    import argparse as source_module

    return model.encode(inspect.getsource(source_module))


def workload(tokens: list[int], context: int, batch: int):
    prefix = tokens[: context - SUFFIX]
    suffixes = []
    for i in range(batch):
        start = context + 256 + i * 997  # distinct windows after the prefix
        suffixes.append(tokens[start : start + SUFFIX])
    return prefix, suffixes


def run_mode(
    runner, model, prefix, suffixes, config: EngineConfig, max_new: int, repeats: int
) -> dict:
    samples, outputs, stats = [], None, None
    for _ in range(repeats):
        engine = Engine(runner, config, model.eos_token_ids)
        prefix.artifacts.clear()  # compression is timed in every repeat
        requests = [Request(prefix, list(s), max_new) for s in suffixes]
        t0 = time.perf_counter()
        results = engine.run(requests)
        elapsed = time.perf_counter() - t0
        tokens = [r.tokens for r in results]
        if outputs is not None and tokens != outputs:
            raise SystemExit(f"{config}: tokens differ between repeats")
        outputs, stats = tokens, dict(results[0].stats)
        if config.mode == "vericache":  # acceptance over every request of the batch
            for key in ("verifications", "drafted", "accepted", "draft_steps"):
                stats[key] = sum(r.stats[key] for r in results)
            stats["accepted_per_verification"] = round(
                stats["accepted"] / max(1, stats["verifications"]), 3
            )
            stats["drafts_per_draft_step"] = round(
                stats["drafted"] / max(1, stats["draft_steps"]), 3
            )
            stats["accepted_histogram"] = plots.merged_histogram(
                r.stats.get("accepted_histogram", {}) for r in results
            )
        if config.ngram:
            for key in ("ngram_proposed", "ngram_accepted"):
                stats[key] = sum(r.stats[key] for r in results)
        generated = sum(len(t) for t in tokens)
        step_s = stats["draft_s"] if config.mode == "vericache" else stats["decode_s"]
        samples.append(
            {"tok_s": generated / elapsed, "step_s": step_s / max(1, stats["batch_steps"])}
        )
    agg = {k: statistics.median(s[k] for s in samples) for k in ("tok_s", "step_s")}
    return {"tokens": outputs, "stats": stats, **agg, "samples": samples}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bench_case(runner, model, tokens, context, batch, args, prefix, prefill_s, bar) -> list[dict]:
    """Every mode of one (context, batch) case; `bar` advances by one per mode run."""
    _, suffixes = workload(tokens, context, batch)
    note(f"\n== context {context}, batch {batch} (prefix prefill {prefill_s:.1f}s)")
    rows = []

    def measure(config: EngineConfig) -> dict:
        spec = "" if config.mode == "full" else config.compressor
        bar.set_postfix_str(f"ctx {context} batch {batch} {config.mode} {spec}")
        return run_mode(runner, model, prefix, suffixes, config, args.max_new_tokens, args.repeats)

    def add(row: dict) -> None:
        rows.append(row)
        _print(row)
        bar.update(1)

    full = measure(EngineConfig(mode="full"))
    add(_row(context, batch, "full", "-", full, full, None, prefill_s))
    if args.ngram:
        res = measure(EngineConfig(mode="full", ngram=args.ngram))
        add(_row(context, batch, "full+ngram", "-", res, full, None, prefill_s))
    for spec in args.compressors:
        lossy = measure(EngineConfig(mode="lossy", compressor=spec))
        add(_row(context, batch, "lossy", spec, lossy, full, None, prefill_s))
        for horizon in [None] + (args.horizons if spec == _horizon_spec(args) else []):
            vc = measure(EngineConfig(mode="vericache", compressor=spec, horizon=horizon))
            add(_row(context, batch, "vericache", spec, vc, full, lossy, prefill_s, horizon))
        if args.ngram:
            vc = measure(EngineConfig(mode="vericache", compressor=spec, ngram=args.ngram))
            add(_row(context, batch, "vericache+ngram", spec, vc, full, lossy, prefill_s))
    return rows


def _horizon_spec(args) -> str:
    return HORIZON_SPEC if HORIZON_SPEC in args.compressors else args.compressors[0]


def runs_per_case(args) -> int:
    """Mode runs in one (context, batch) case (what the progress bar counts)."""
    per_spec = 2 + (1 if args.ngram else 0)  # lossy, vericache auto (+ngram)
    return 1 + (1 if args.ngram else 0) + per_spec * len(args.compressors) + len(args.horizons)


def _compared(mode: str, res: dict, full: dict) -> tuple[bool | None, int | None]:
    """(identical to the full-KV reference, first token where a reply diverges): (None,
    None) for the reference itself, which is never compared with itself."""
    if mode == "full":
        return None, None
    if res["tokens"] == full["tokens"]:
        return True, None
    pairs = zip(res["tokens"], full["tokens"], strict=True)
    return False, min(d for d in (first_divergence(a, b) for a, b in pairs) if d is not None)


def _row(context, batch, mode, spec, res, full, lossy, prefill_s, horizon=None) -> dict:
    stats = res["stats"]
    identical, divergence = _compared(mode, res, full)
    row = {
        "context": context,
        "batch": batch,
        "mode": mode,
        "compressor": spec,
        "horizon": "-"
        if not mode.startswith("vericache")
        else ("auto" if horizon is None else horizon),
        "compression_ratio": stats.get("compression_ratio", 1.0),
        "tok_s": round(res["tok_s"], 3),
        "vs_full": round(res["tok_s"] / full["tok_s"], 3),
        "spread": spreads_json({"tok_s": spread(s["tok_s"] for s in res["samples"])}),
        "identical": identical,
        "first_divergence": divergence,
        "step_ms": round(1000 * res["step_s"], 2),  # vericache: mean draft step
        "prefix_prefill_s": round(prefill_s, 2),
        "compressed_bytes": stats.get("compressed_bytes"),
        "full_bytes": stats["full_bytes"],
        "peak_staging_bytes": stats["peak_staging_bytes"],
    }
    if mode == "lossy":
        row["draft_step_speedup"] = round(full["step_s"] / res["step_s"], 3)
    if "ngram_proposed" in stats:
        row["ngram_proposed"], row["ngram_accepted"] = (
            stats["ngram_proposed"],
            stats["ngram_accepted"],
        )
    if mode.startswith("vericache"):
        v = stats["verifications"]
        row.update(
            accepted_per_verification=stats["accepted_per_verification"],
            drafts_per_draft_step=stats["drafts_per_draft_step"],
            verifications=v,
            drafted=stats["drafted"],
            accepted=stats["accepted"],
            draft_step_speedup=round(full["step_s"] / lossy["step_s"], 3),
            accepted_histogram=stats["accepted_histogram"],
        )
        accept_fraction = stats["accepted"] / max(1, stats["drafted"])
        # a draft forward gives `drafts_per_draft_step` drafts (more than one with n-gram)
        per_forward = max(1.0, stats["drafts_per_draft_step"])
        row["bound"] = round(row["draft_step_speedup"] * per_forward * accept_fraction, 3)
        row["share_of_bound"] = round(row["vs_full"] / row["bound"], 3) if row["bound"] else None
        row["draft_s"], row["verify_s"] = stats["draft_s"], stats["verify_s"]
    return row


COLUMNS = [
    ("context", "ctx"),
    ("batch", "batch"),
    ("mode", "mode"),
    ("compressor", "compressor"),
    ("horizon", "horizon"),
    ("compression_ratio", "ratio"),
    ("accepted_per_verification", "acc/verif"),
    ("drafts_per_draft_step", "drafts/fwd"),
    ("draft_step_speedup", "draft-step speedup"),
    ("bound", "bound"),
    ("share_of_bound", "of bound"),
    ("tok_s", "tok/s"),
    ("vs_full", "vs full"),
    ("identical", "identical"),
    ("first_divergence", "diverges at"),
]


def _cell(row: dict, key: str) -> str:
    """A column's text: `identical` as "reference" (the full-KV row), "yes" or "no"; a
    missing value as "-"."""
    value = row.get(key)
    if key == "identical":
        return "reference" if value is None else ("yes" if value else "no")
    return "-" if value is None else str(value)


def _print(row: dict) -> None:
    note("  " + "  ".join(f"{title}={_cell(row, key)}" for key, title in COLUMNS))


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(t for _, t in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row, key) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compressors", nargs="+", default=COMPRESSORS)
    parser.add_argument(
        "--ngram", type=int, default=8, help="prompt-lookup guesses per forward (0: no rows)"
    )
    parser.add_argument(
        "--horizons",
        type=int,
        nargs="*",
        default=[8, 16, 32],
        help=f"fixed horizons also run with {HORIZON_SPEC} (else the first compressor)",
    )
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out", type=Path, default=Path("bench/results/local.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model()
    runner = ModelRunner(model.config, model.weights)
    runner.ensure_exact_supported()
    tokens = source_tokens(model)
    rows = []
    cases = len(args.contexts) * len(args.batches)
    bar = progress(desc="bench_local", total=cases * runs_per_case(args), unit="run")
    for context in args.contexts:
        t0 = time.perf_counter()
        bar.set_postfix_str(f"ctx {context} prefix prefill")
        prefix = prefill_prefix(runner, workload(tokens, context, 1)[0], observe=128)
        prefill_s = time.perf_counter() - t0
        for batch in args.batches:
            case = bench_case(runner, model, tokens, context, batch, args, prefix, prefill_s, bar)
            rows.extend(case)
            _write(args, rows)
        del prefix
    bar.close()
    print("\n" + markdown(rows))
    print(f"\nwrote {args.out}")
    write_plots(args.out, rows)


def write_plots(out: Path, rows: list[dict]) -> list[Path]:
    """local-horizon.png and local-accepted.png beside the JSON."""
    return plots.write_figures(
        out,
        [
            ("horizon", plots.tokens_per_s_vs_horizon, rows),
            ("accepted", plots.accepted_histogram, _histogram_rows(rows)),
        ],
    )


def _histogram_rows(rows: list[dict]) -> list[dict]:
    """The rows whose acceptance the histogram shows: the horizon sweep's compressor at the
    automatic horizon (with and without n-gram), every case; else every row."""
    specs = [r["compressor"] for r in rows if r["compressor"] != "-"]
    spec = HORIZON_SPEC if HORIZON_SPEC in specs else next(iter(specs), None)
    picked = [r for r in rows if r["compressor"] == spec and r["horizon"] == "auto"]
    return picked or rows


def _write(args, rows) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": "SmolLM2-135M-Instruct (built-in)",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "suffix_tokens": SUFFIX,
        "ngram": args.ngram,
        "horizons": args.horizons,
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
