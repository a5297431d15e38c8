"""Decoder footprint: whole processes, side by side with `transformers`.

Each row is a fresh process, timed from its start to its exit, with its peak resident
memory (the kernel's `ru_maxrss` of that child, from `wait4`); rows alternate pair by pair
and the table shows medians over `--repeats` (3) runs with their range [min-max] (also under
"spread" in the JSON, bench/stats.py):

- `vericache generate`: `vericache generate --json --prompt PROMPT --max-new-tokens N` in
  process (the built-in model, exact mode, full-KV decoding);
- `transformers generate`: `AutoModelForCausalLM.from_pretrained` on the same converted
  folder, then greedy `generate` of the same N tokens (fp32, CPU);
- `vericache --help`: the CLI's start-up alone.

Every row runs once untimed first (warm: the model cache, the self-check cache, the page
cache of both sides' files). Both generate rows print their tokens; every run of either
must give the same tokens, else the bench says where they differ and exits 1.

Usage: python bench/bench_footprint.py [--repeats 3] [--max-new-tokens 32]
       [--out bench/results/footprint.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stats import DEFAULT_REPEATS, row_text, spreads, spreads_json  # noqa: E402
from decoder.progress import progress  # noqa: E402

PROMPT = "def fibonacci(n):"
GENERATES = ("vericache generate", "transformers generate")
"""The rows that generate tokens: each run of them must give the same ones."""
TRANSFORMERS = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from decoder.loader import builtin_model_dir, default_cache_dir
folder = builtin_model_dir(default_cache_dir())
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
ids = tokenizer(sys.argv[1], return_tensors="pt").input_ids
with torch.inference_mode():
    out = model.generate(ids, max_new_tokens=int(sys.argv[2]), min_new_tokens=int(sys.argv[2]),
                         do_sample=False)
print(json.dumps({"tokens": out[0, ids.shape[1]:].tolist()}))
"""


@dataclass(frozen=True)
class Run:
    """One child process run to its end."""

    wall_s: float
    peak_rss_bytes: int
    stdout: str


def measure(command: list[str]) -> Run:
    """Run `command` as a child process to its end: its wall time, peak RSS and output.
    RuntimeError, with the end of its stderr, when it fails."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        if status != 0:
            raise RuntimeError(f"{command[:3]} failed: {err.read().decode()[-500:]}")
        return Run(wall, usage.ru_maxrss * 1024, out.read().decode())


def generated_tokens(run: Run) -> list[int]:
    """The tokens a generate row printed: the "tokens" of its last output line (JSON)."""
    lines = run.stdout.strip().splitlines()
    return json.loads(lines[-1])["tokens"] if lines else []


def token_mismatch(runs: dict[str, list[Run]]) -> str | None:
    """Where the `GENERATES` rows' runs disagree on the tokens (None: every run of both gave
    the same ones): the first run that differs from the first vericache run."""
    expected = generated_tokens(runs[GENERATES[0]][0])
    for name in GENERATES:
        for i, run in enumerate(runs[name]):
            got = generated_tokens(run)
            if got != expected:
                return (
                    f"{name} run {i} generated different tokens from {GENERATES[0]} run 0 "
                    f"({first_difference(got, expected)}): {got} vs {expected}"
                )
    return None


def first_difference(got: list[int], expected: list[int]) -> str:
    """Where two different token lists part: "token i", or their lengths."""
    for i, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return f"token {i}"
    return f"{len(got)} tokens, not {len(expected)}"


def summary_row(name: str, runs: list[Run]) -> dict:
    """A table row: the median wall time and peak RSS of `runs`, their ranges under
    "spread", and every run's (wall seconds, peak RSS bytes)."""
    figures = spreads([vars(run) for run in runs], ("wall_s", "peak_rss_bytes"))
    return {
        "process": name,
        **{key: figure.median for key, figure in figures.items()},
        "spread": spreads_json(figures),
        "runs": [(run.wall_s, run.peak_rss_bytes) for run in runs],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench/results/footprint.json"))
    args = ap.parse_args(argv)
    n = str(args.max_new_tokens)
    cli = [sys.executable, "-m", "cluster.cli"]
    generate = ["generate", "--json", "--prompt", PROMPT, "--max-new-tokens", n]
    rows = {
        "vericache generate": cli + generate,
        "transformers generate": [sys.executable, "-c", TRANSFORMERS, PROMPT, n],
        "vericache --help": cli + ["--help"],
    }
    warm = {name: [measure(command)] for name, command in rows.items()}  # untimed
    mismatch = token_mismatch(warm)
    if mismatch:
        print(f"bench_footprint: {mismatch}", file=sys.stderr)
        return 1
    runs: dict[str, list[Run]] = {name: [] for name in rows}
    for _ in progress(range(args.repeats), desc="bench_footprint", unit="round"):
        for name, command in rows.items():
            runs[name].append(measure(command))
    mismatch = token_mismatch({name: warm[name] + runs[name] for name in GENERATES})
    if mismatch:
        print(f"bench_footprint: {mismatch}", file=sys.stderr)
        return 1
    table = [summary_row(name, values) for name, values in runs.items()]
    ours, theirs = table[0], table[1]
    print(f"medians [min-max] of {args.repeats} runs; both generates gave the same tokens")
    print("| process | wall s | peak RSS MB |")
    print("|---|---|---|")
    for row in table:
        rss = row_text(row, "peak_rss_bytes", ".0f", 1e-6)
        print(f"| {row['process']} | {row_text(row, 'wall_s')} | {rss} |")
    ratios = {
        "rss_vs_transformers": ours["peak_rss_bytes"] / theirs["peak_rss_bytes"],
        "wall_vs_transformers": ours["wall_s"] / theirs["wall_s"],
        "help_s": table[2]["wall_s"],
    }
    print(
        f"vericache / transformers: peak RSS {ratios['rss_vs_transformers']:.2f}x (target <= "
        f"1.2x), wall {ratios['wall_vs_transformers']:.2f}x (target <= 1.0x); --help "
        f"{ratios['help_s']:.2f} s (target < 1 s)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "workload": {
            "prompt": PROMPT,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
        },  # fmt: skip
        "tokens": generated_tokens(warm[GENERATES[0]][0]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows": table,
        "ratios": ratios,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
