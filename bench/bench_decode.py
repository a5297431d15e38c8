"""Decode speed: our exact mode, our fast mode and `transformers` `generate`, side by side.

For each context length the prompt (a real Python source file, tokenized) is prefilled
once per engine; each batch row then continues from a copy of that prefix with its own
next token, so rows decode different sequences at the same context. Timings are medians
over `--repeats` (3) runs of a fixed number of decode steps, with their range [min-max] in
the tables and under "spread" in the JSON (bench/stats.py), and the table reports ratios to
`transformers` measured in the same run. `transformers` runs its own `generate` on a
prefilled `DynamicCache` (so its timed work is decode steps only). "fast" runs with the
runner's default draft weights (`RunnerConfig.draft_weights`); a second table times fast
mode with each `--draft-weights` setting (one runner each, the same prefix), interleaved.

Usage: python bench/bench_decode.py [--contexts 512 2048 8192] [--batches 1 8]
       [--steps 8] [--repeats 3] [--draft-weights fp32 int8 fp16 bf16]
       [--out bench/results/decode.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import time
from pathlib import Path
from typing import get_args

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stats import DEFAULT_REPEATS, Spread, row_text, spread, spreads_json  # noqa: E402
from decoder.config import DraftWeights, RunnerConfig  # noqa: E402
from decoder.kv_cache import KVCache  # noqa: E402
from decoder.loader import load_model  # noqa: E402
from decoder.progress import note, progress  # noqa: E402
from decoder.runner import ModelRunner, SeqInput  # noqa: E402


def long_code_tokens(model, n: int) -> list[int]:
    """n tokens of real Python source (the standard library's argparse, repeated if short)."""
    import argparse as source_module

    ids = model.encode(inspect.getsource(source_module))
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def time_ours(runner, prefix: KVCache, batch: int, steps: int, repeats: int, mode: str) -> Spread:
    """Seconds per decode step for `batch` rows continuing `prefix`, over `repeats` runs."""
    samples = []
    for _ in range(repeats):
        caches = [prefix.clone(extra_capacity=steps + 1) for _ in range(batch)]
        tokens = [[100 + row] for row in range(batch)]
        start = time.perf_counter()
        for _ in range(steps):
            logits = runner.forward(
                [SeqInput.extend(c, t) for c, t in zip(caches, tokens, strict=True)], mode
            )
            tokens = [[int(lg[-1].argmax())] for lg in logits]
        samples.append((time.perf_counter() - start) / steps)
    return spread(samples)


def time_draft_weights(
    runners: dict[str, ModelRunner], prefix: KVCache, batch: int, steps: int, repeats: int
) -> dict[str, Spread]:
    """Seconds per fast-mode decode step for each draft-weights runner over `repeats` runs,
    interleaved (one run of each in turn, so that a noisy neighbour hits them alike)."""
    samples: dict[str, list[float]] = {kind: [] for kind in runners}
    for _ in range(repeats):
        for kind, runner in runners.items():
            samples[kind].append(time_ours(runner, prefix, batch, steps, 1, "fast").median)
    return {kind: spread(s) for kind, s in samples.items()}


def time_transformers(hf, prompt: list[int], batch: int, steps: int, repeats: int) -> Spread:
    """Seconds per `generate` decode step for `batch` rows after `prompt`, over `repeats`
    runs."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(batch)
    ids = torch.tensor([prompt + [100 + row] for row in range(batch)])
    samples = []
    for _ in range(repeats):
        cache.crop(len(prompt) - cache.get_seq_length())  # roll back to the prompt
        start = time.perf_counter()
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
        samples.append((time.perf_counter() - start) / steps)
    return spread(samples)


def decode_row(context: int, batch: int, step: dict[str, Spread], drafts: dict[str, Spread]):
    """A table row from seconds per step (exact, fast, transformers; fast per draft
    weights): ms per step and per token (medians), speeds vs transformers (ratios of
    medians), and each ms per token's range under "spread"."""
    per_token = {f"{k}_ms_per_token": v.scaled(1e3 / batch) for k, v in step.items()}
    per_token |= {f"draft_{k}_ms_per_token": v.scaled(1e3 / batch) for k, v in drafts.items()}
    return {
        "context": context,
        "batch": batch,
        **{f"{k}_ms_per_step": round(v.median * 1e3, 2) for k, v in step.items()},
        **{f"{k}_ms_per_token": round(v.median * 1e3 / batch, 2) for k, v in step.items()},
        "exact_vs_transformers": round(step["transformers"].median / step["exact"].median, 3),
        "fast_vs_transformers": round(step["transformers"].median / step["fast"].median, 3),
        "draft_weights_ms_per_token": {
            kind: round(v.median * 1e3 / batch, 2) for kind, v in drafts.items()
        },
        "spread": spreads_json(per_token),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    p.add_argument(
        "--draft-weights",
        nargs="*",
        default=list(get_args(DraftWeights)),
        choices=get_args(DraftWeights),
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/decode.json"))
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    model = load_model()
    runner = ModelRunner(model.config, model.weights)
    runner.ensure_exact_supported()
    drafters = {
        kind: ModelRunner(model.config, model.weights, RunnerConfig(draft_weights=kind))
        for kind in args.draft_weights
    }
    for r in [runner, *drafters.values()]:  # build the draft weights outside the timings
        r.forward([SeqInput.extend(r.new_cache(), [1])], "fast")
    hf = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=torch.float32).eval()
    rows = []
    bar = progress(desc="bench_decode", total=len(args.contexts) * len(args.batches), unit="case")
    for context in args.contexts:
        prompt = long_code_tokens(model, context)
        prefix = runner.new_cache(capacity=context)
        t0 = time.perf_counter()
        runner.forward([SeqInput.extend(prefix, prompt, "none")])
        note(f"context {context}: exact prefill {time.perf_counter() - t0:.1f}s")
        for batch in args.batches:
            bar.set_postfix_str(f"ctx {context} batch {batch}")
            step = {
                "exact": time_ours(runner, prefix, batch, args.steps, args.repeats, "exact"),
                "fast": time_ours(runner, prefix, batch, args.steps, args.repeats, "fast"),
                "transformers": time_transformers(hf, prompt, batch, args.steps, args.repeats),
            }
            drafts = time_draft_weights(drafters, prefix, batch, args.steps, args.repeats)
            row = decode_row(context, batch, step, drafts)
            rows.append(row)
            note(_format_row(row))
            bar.update(1)
        del prefix
    bar.close()

    print("\n" + _table(rows))
    if args.draft_weights:
        print("\n" + _draft_table(rows, args.draft_weights))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": model.name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "steps": args.steps,
        "repeats": args.repeats,
        "default_draft_weights": RunnerConfig().draft_weights,
        "draft_weight_bytes": {kind: r.draft_weight_bytes for kind, r in drafters.items()},
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")


def _format_row(row: dict) -> str:
    return (
        f"ctx {row['context']:>5} batch {row['batch']}: exact {row['exact_ms_per_step']} ms, "
        f"fast {row['fast_ms_per_step']} ms, transformers "
        f"{row['transformers_ms_per_step']} ms per step"
    )


def _table(rows: list[dict]) -> str:
    head = (
        "| context | batch | exact ms/tok | fast ms/tok | transformers ms/tok "
        "| exact speed vs transformers | fast speed vs transformers |"
    )
    lines = [_runs_line(rows), head, "|" + "---|" * 7]
    for r in rows:
        cells = [row_text(r, f"{k}_ms_per_token") for k in ("exact", "fast", "transformers")]
        lines.append(
            f"| {r['context']} | {r['batch']} | " + " | ".join(cells) + " | "
            f"{r['exact_vs_transformers']}x | {r['fast_vs_transformers']}x |"
        )
    return "\n".join(lines)


def _runs_line(rows: list[dict]) -> str:
    """What the cells are: "median [min-max] of N runs"."""
    runs = sorted({s["runs"] for r in rows for s in r["spread"].values()})
    return f"ms per token: median [min-max] of {'/'.join(map(str, runs))} runs"


def _draft_table(rows: list[dict], kinds: list[str]) -> str:
    """Fast-mode ms per token with each draft-weights setting, and speed vs fp32's."""
    head = "| context | batch | " + " | ".join(f"fast {k} ms/tok" for k in kinds) + " |"
    lines = [_runs_line(rows), head, "|" + "---|" * (2 + len(kinds))]
    for r in rows:
        ms = r["draft_weights_ms_per_token"]
        base = ms.get("fp32")
        cells = [
            row_text(r, f"draft_{k}_ms_per_token")
            + (f" ({base / ms[k]:.2f}x)" if base and k != "fp32" else "")
            for k in kinds
        ]
        lines.append(f"| {r['context']} | {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
