"""Exact attention alone: the fused kernel against the torch implementation.

Verification-shaped calls of SmolLM2-135M's attention (9 query heads, 3 kv heads, head_dim
64, fp32): a few query tokens at the end of a 4K or 8K context, as one layer of an exact
pass sees them. The two implementations are timed interleaved (the machine may be shared)
and the table reports medians of wall time per call over `--repeats` (15) runs, with their
range [min-max] (also under "spread" in the JSON, bench/stats.py), and the ratio of the
medians.

With --passes, also whole exact forward passes of the built-in model (30 layers): a
verification of T tokens over a prefix of each context (its KV random: timing does not
depend on the values), with either kernel. With --shared, exact passes of many requests
over one prefix buffer (`SharedPrefixView`s), with the prefix attended once for all of them
(one `prefix_id`) and per request (none): a verification of R x T tokens and a decode step
of R x 1. With --drafts, draft steps (fast mode, fp16 draft weights) of 1, 2, 4, 8 and 16
requests over one compressed prefix (an eighth of each context, kept by StreamingLLM; the
requests' own tails 48-64 tokens), their attention stacked (`DraftStack`) and per request.
Passes and steps run max(3, repeats / 3) times.

Usage: python bench/bench_attention.py [--contexts 4096 8192] [--tokens 1 4 8 16 32]
       [--repeats 15] [--threads N] [--passes] [--shared] [--requests 16] [--drafts]
       [--out bench/results/attention.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stats import row_text, spread, spreads_json  # noqa: E402
from decoder.progress import note, progress  # noqa: E402
from numerics.cpu.forward import AttentionPlan, exact_attention, exact_kernel_id  # noqa: E402

HEADS, KV_HEADS, DIM, CHUNK = 9, 3, 64, 256


def timed_row(samples: dict[str, list[float]], digits: int) -> dict:
    """From seconds per run of two implementations (slower one first): "<name>_ms", each
    one's median ms rounded to `digits`; "speedup", the first's median over the second's;
    and each one's range under "spread"."""
    figures = {f"{name}_ms": spread(s).scaled(1e3) for name, s in samples.items()}
    first, second = figures.values()
    return {
        **{key: round(figure.median, digits) for key, figure in figures.items()},
        "speedup": round(first.median / second.median, 2),
        "spread": spreads_json(figures),
    }


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_shape(context: int, tokens: int, repeats: int) -> dict:
    """Median ms per call of both implementations, interleaved call by call."""
    g = torch.Generator().manual_seed(context + tokens)
    keys = torch.randn(KV_HEADS, context, DIM, generator=g)
    values = torch.randn(KV_HEADS, context, DIM, generator=g)
    q = torch.randn(tokens, HEADS, DIM, generator=g) / DIM**0.5
    positions = torch.arange(context - tokens, context)
    plans = {
        name: AttentionPlan.build(
            positions, HEADS // KV_HEADS, key_chunk=CHUNK, row_tile=4, query_block=256, fused=f
        )
        for name, f in (("torch", False), ("fused", True))
    }
    samples: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(repeats):
        for name, plan in plans.items():
            samples[name].append(_once(lambda p=plan: exact_attention(q, keys, values, p)))
    return {"context": context, "tokens": tokens, **timed_row(samples, 3)}


def bench_pass(runner, context: int, tokens: int, repeats: int) -> dict:
    """Median ms of one exact verification pass of `tokens` tokens over `context` cached
    tokens, with the fused kernel and with the torch one, interleaved."""
    import decoder.runner as runner_module

    prefix = _random_cache(runner, context, tokens)
    ids = list(range(100, 100 + tokens))
    real = runner_module.fused_kernel
    kernels = {"torch": lambda head_dim: None, "fused": real}
    samples: dict[str, list[float]] = {name: [] for name in kernels}
    try:
        for _ in range(repeats):
            for name, kernel in kernels.items():
                runner_module.fused_kernel = kernel
                for layer in prefix.layers:
                    layer.truncate(context)
                seq = runner_module.SeqInput.extend(prefix, ids, "all")
                samples[name].append(_once(lambda s=seq: runner.forward([s])))
    finally:
        runner_module.fused_kernel = real
    return {"context": context, "tokens": tokens, **timed_row(samples, 1)}


def bench_shared(runner, context: int, requests: int, tokens: int, repeats: int) -> dict:
    """Median ms of one exact pass of `requests` x `tokens` new tokens over one shared
    prefix of `context` tokens, stacked (one prefix_id) and per request, interleaved."""
    from decoder.runner import SeqInput
    from decoder.views import SharedPrefixView

    buffer = _random_cache(runner, context, tokens + 16)
    samples: dict[str, list[float]] = {"per_request": [], "stacked": []}
    for _ in range(repeats):
        for name in samples:
            prefix_id = object() if name == "stacked" else None
            seqs = [
                SeqInput.extend(
                    SharedPrefixView(
                        lambda i: buffer.layers[i], context, runner.new_cache(), prefix_id
                    ),
                    list(range(100 + r, 100 + r + tokens)),
                    "all",
                )
                for r in range(requests)
            ]
            samples[name].append(_once(lambda s=seqs: runner.forward(s)))
    return {"context": context, "requests": requests, "tokens": tokens, **timed_row(samples, 1)}


def bench_drafts(runner, context: int, requests: int, repeats: int) -> dict:
    """Median ms of one draft step of `requests` x 1 token over one compressed prefix of an
    eighth of `context` tokens, stacked and per request, interleaved."""
    import decoder.runner as runner_module
    from decoder.compressors import parse_compressor
    from decoder.draft_cache import DraftCache, DraftPrefix, DraftScratch
    from decoder.kv_source import LocalKVSource

    c = runner.config
    pipeline = parse_compressor(f"streamingllm:sink=4,window={context // 8 - 4}")
    source = LocalKVSource(_random_cache(runner, context, 0), context)
    compressed = pipeline.compress(source, None, c.num_layers, c.num_kv_heads, c.head_dim)
    scratch = DraftScratch(c.num_kv_heads, c.head_dim)
    prefix = DraftPrefix(compressed, c.num_kv_heads, c.head_dim, scratch)
    caches = [DraftCache(prefix, 80) for _ in range(requests)]
    for r, cache in enumerate(caches):  # own tails of 48 + r tokens
        tail = runner_module.SeqInput.extend(cache, list(range(100, 148 + r)), "none")
        runner.forward([tail], "fast")
    real = runner_module.draft_stacks
    ways = {"per_request": lambda *args: {}, "stacked": real}
    samples: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for _ in range(repeats):
            for name, way in ways.items():
                runner_module.draft_stacks = way
                seqs = [runner_module.SeqInput.extend(cache, [42], "all") for cache in caches]
                samples[name].append(_once(lambda s=seqs: runner.forward(s, "fast")))
                for cache in caches:
                    cache.truncate(cache.tail_length - 1)
    finally:
        runner_module.draft_stacks = real
    return {"context": context, "requests": requests, **timed_row(samples, 1)}


def _random_cache(runner, context: int, extra: int):
    cache = runner.new_cache(capacity=context + extra)
    g = torch.Generator().manual_seed(context)
    for layer in cache.layers:
        k = torch.randn(layer.k.shape[0], context, layer.k.shape[2], generator=g)
        layer.append(k, torch.randn(k.shape, generator=g), torch.arange(context))
    return cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("bench/results/attention.json"))
    p.add_argument("--passes", action="store_true", help="also time whole exact passes")
    p.add_argument("--shared", action="store_true", help="also time shared-prefix passes")
    p.add_argument("--requests", type=int, default=16, help="requests over the shared prefix")
    p.add_argument("--drafts", action="store_true", help="also time stacked draft steps")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = exact_kernel_id(DIM)
    if not kernel.startswith("fused"):
        sys.exit("the fused kernel is unavailable here: nothing to compare")
    rows = []
    for context, tokens in progress(_shapes(args), desc="attention calls", unit="shape"):
        row = bench_shape(context, tokens, args.repeats)
        rows.append(row)
        note(
            f"ctx {context} x {tokens} tokens: torch {row['torch_ms']} ms, "
            f"fused {row['fused_ms']} ms ({row['speedup']}x)"
        )
    print(f"\nms per call: median [min-max] of {args.repeats} runs")
    print("| context | query tokens | torch ms | fused ms | speedup |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['context']} | {r['tokens']} | {row_text(r, 'torch_ms', '.3f')} | "
            f"{row_text(r, 'fused_ms', '.3f')} | {r['speedup']}x |"
        )
    passes = _passes(args) if args.passes else []
    shared = _shared(args) if args.shared else []
    drafts = _drafts(args) if args.drafts else []
    meta = {
        "kernel": kernel,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "repeats": args.repeats,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"meta": meta, "rows": rows, "passes": passes, "shared": shared, "drafts": drafts},
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")


def pass_repeats(args) -> int:
    """Runs per whole-pass measurement (--passes, --shared): a third of --repeats, at least 3."""
    return max(3, args.repeats // 3)


def _shapes(args) -> list[tuple[int, int]]:
    """(context, query tokens) of every call shape, in the tables' order."""
    return [(context, tokens) for context in args.contexts for tokens in args.tokens]


def _runner():
    from decoder.loader import load_model
    from decoder.runner import ModelRunner

    model = load_model()
    runner = ModelRunner(model.config, model.weights)
    runner.ensure_exact_supported()
    return runner


def _shared(args) -> list[dict]:
    runner = _runner()
    rows = []
    shapes = [(context, tokens) for context in args.contexts for tokens in (4, 1)]
    for context, tokens in progress(shapes, desc="shared-prefix passes", unit="shape"):
        row = bench_shared(runner, context, args.requests, tokens, pass_repeats(args))
        rows.append(row)
        note(
            f"{args.requests} requests x {tokens} tokens over one {context}-token prefix: "
            f"per request {row['per_request_ms']} ms, stacked {row['stacked_ms']} ms "
            f"({row['speedup']}x)"
        )
    print(f"\nms per pass: median [min-max] of {pass_repeats(args)} runs")
    print(
        "| prefix | requests x tokens | per request ms | stacked ms | speedup |"
        "\n|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['context']} | {r['requests']} x {r['tokens']} | "
            f"{row_text(r, 'per_request_ms', '.1f')} | {row_text(r, 'stacked_ms', '.1f')} | "
            f"{r['speedup']}x |"
        )
    return rows


def _drafts(args) -> list[dict]:
    runner = _runner()
    runner.prepare_fast()
    rows = []
    shapes = [(context, n) for context in args.contexts for n in (1, 2, 4, 8, 16)]
    for context, requests in progress(shapes, desc="draft steps", unit="shape"):
        row = bench_drafts(runner, context, requests, pass_repeats(args))
        rows.append(row)
        note(
            f"draft step of {requests} over one {context // 8}-token compressed prefix: per "
            f"request {row['per_request_ms']} ms, stacked {row['stacked_ms']} ms "
            f"({row['speedup']}x)"
        )
    print(f"\nms per draft step: median [min-max] of {pass_repeats(args)} runs")
    print(
        "| context (compressed) | requests | per request ms | stacked ms | speedup |"
        "\n|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['context']} ({r['context'] // 8}) | {r['requests']} | "
            f"{row_text(r, 'per_request_ms', '.1f')} | {row_text(r, 'stacked_ms', '.1f')} | "
            f"{r['speedup']}x |"
        )
    return rows


def _passes(args) -> list[dict]:
    runner = _runner()
    rows = []
    for context, tokens in progress(_shapes(args), desc="exact passes", unit="shape"):
        row = bench_pass(runner, context, tokens, pass_repeats(args))
        rows.append(row)
        note(
            f"pass over {context} x {tokens} tokens: torch {row['torch_ms']} ms, "
            f"fused {row['fused_ms']} ms ({row['speedup']}x)"
        )
    print(f"\nms per pass: median [min-max] of {pass_repeats(args)} runs")
    print("| context | tokens | exact pass, torch ms | fused ms | speedup |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['context']} | {r['tokens']} | {row_text(r, 'torch_ms', '.1f')} | "
            f"{row_text(r, 'fused_ms', '.1f')} | {r['speedup']}x |"
        )
    return rows


if __name__ == "__main__":
    main()
