"""Decoder footprint: whole processes, side by side with `transformers`.

Each row is a fresh process, timed from its start to its exit, with its peak resident
memory (the kernel's `ru_maxrss` of that child, from `wait4`); rows alternate pair by pair
and the table shows medians over `--repeats` runs:

- `vericache generate`: `vericache generate --prompt PROMPT --max-new-tokens N` in process
  (the built-in model, exact mode, full-KV decoding: the same tokens as below);
- `transformers generate`: `AutoModelForCausalLM.from_pretrained` on the same converted
  folder, then greedy `generate` of the same N tokens (fp32, CPU);
- `vericache --help`: the CLI's start-up alone.

Usage: python bench/bench_footprint.py [--repeats 3] [--max-new-tokens 32]
       [--out bench/results/footprint.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decoder.progress import progress  # noqa: E402

PROMPT = "def fibonacci(n):"
TRANSFORMERS = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from decoder.loader import builtin_model_dir, default_cache_dir
folder = builtin_model_dir(default_cache_dir())
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
ids = tokenizer(sys.argv[1], return_tensors="pt").input_ids
with torch.inference_mode():
    out = model.generate(ids, max_new_tokens=int(sys.argv[2]), min_new_tokens=int(sys.argv[2]),
                         do_sample=False)
print(out.shape[1] - ids.shape[1])
"""


def measure(command: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process run to its end."""
    t0 = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise RuntimeError(f"{command[:3]} failed: {child.stderr.read().decode()[-500:]}")
    child.stderr.close()
    return wall, usage.ru_maxrss * 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench/results/footprint.json"))
    args = ap.parse_args(argv)
    n = str(args.max_new_tokens)
    cli = [sys.executable, "-m", "cluster.cli"]
    rows = {
        "vericache generate": cli + ["generate", "--prompt", PROMPT, "--max-new-tokens", n],
        "transformers generate": [sys.executable, "-c", TRANSFORMERS, PROMPT, n],
        "vericache --help": cli + ["--help"],
    }
    measure(rows["vericache generate"])  # warm: the model cache and the self-check cache
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in rows}
    for _ in progress(range(args.repeats), desc="bench_footprint", unit="round"):
        for name, command in rows.items():
            runs[name].append(measure(command))
    table = []
    for name, values in runs.items():
        wall = statistics.median(w for w, _ in values)
        rss = statistics.median(r for _, r in values)
        table.append({"process": name, "wall_s": wall, "peak_rss_bytes": rss, "runs": values})
    ours, theirs = table[0], table[1]
    print("| process | wall s | peak RSS MB |")
    print("|---|---|---|")
    for row in table:
        print(f"| {row['process']} | {row['wall_s']:.2f} | {row['peak_rss_bytes'] / 1e6:.0f} |")
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
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows": table,
        "ratios": ratios,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
