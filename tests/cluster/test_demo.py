"""`vericache demo` as a user runs it (small): the local cluster, three tenants, the three
modes, and a table in which every VeriCache request is identical to full-KV decoding, and
the full row is the reference, never compared with itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench.bench_summary import from_demo, rows_of
from cluster.demo import ModeRun, _rows

pytestmark = pytest.mark.cluster


def test_demo_runs_the_service_and_vericache_matches_full(tmp_path):
    command = [
        sys.executable,
        "-m",
        "cluster.cli",
        "demo",
        "--prefix-tokens",
        "512",
        "--requests",
        "3",
        "--max-new-tokens",
        "12",
        "--out",
        str(tmp_path / "demo.json"),
    ]
    env = dict(os.environ, VERICACHE_HOME=str(tmp_path))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "tenants alice, bob, carol" in out and "shared namespace 'docs'" in out
    rows = {
        line.split()[0]: line
        for line in out.splitlines()
        if line.split()[:1] in (["full"], ["lossy"], ["vericache"]) and "x " in line
    }
    assert set(rows) == {"full", "lossy", "vericache"}
    assert "regime: unlimited decoder KV budget: the document's full KV stays resident" in out
    assert rows["vericache"].rstrip().endswith("  3/3")
    # the section 10 bound and the policy's most common choice, for vericache alone
    policy = r"(draft|exact|start|probe|fixed) \d+%"
    split = r"\d(\+\d)?"  # 3 requests over 2 decoders: "3", "2+1"
    assert re.search(rf" \d+\.\d\dx +{policy} +{split}  3/3$", rows["vericache"])
    assert re.search(rf" +- +- +{split}  reference$", rows["full"])
    assert rows["full"].rstrip().endswith("  reference")
    assert re.search(r"  [0-3]/3( \(diverged at token [0-9, ]+\))?$", rows["lossy"].rstrip())
    answer = out.split("What does the dedent function do?\n", 1)[1].split("\n\nLarger:")[0]
    assert answer.strip() and "dedent" in answer.lower()  # the question, answered
    assert "Larger: vericache demo --prefix-tokens" in out
    assert "router at" in out and "served by (through the router" in out
    # the same table as JSON, which bench-summary reads
    (row,) = rows_of(from_demo(json.loads((tmp_path / "demo.json").read_text())))
    assert (row.mode, row.identical, row.lossless) == ("vericache", "3/3", True)
    assert f"{row.vs_full:.2f}x" in rows["vericache"]


def _run(mode: str, wall_s: float, tokens: list[list[int]]) -> ModeRun:
    replies = [SimpleNamespace(tokens=t, stats={"worker": "decoder-0"}) for t in tokens]
    return ModeRun(mode, wall_s, replies, [wall_s] * len(replies))


def test_repeated_runs_give_medians_and_call_identical_only_what_every_run_matched():
    """`--repeats`: each mode's median tokens/s with its range; a request counts as
    identical only if it equals full KV in every run (here vericache's third run differs)."""
    same, other = [[1, 2], [3, 4]], [[1, 9], [3, 4]]
    runs = {
        "full": [_run("full", wall, same) for wall in (1.0, 2.0, 4.0)],
        "lossy": [_run("lossy", 1.0, [[1, 2], [3, 5]]) for _ in range(3)],
        "vericache": [_run("vericache", 1.0, same), _run("vericache", 0.5, same),
                      _run("vericache", 2.0, other)],
    }  # fmt: skip
    full, lossy, vericache = _rows(runs)
    assert full["tok_s"] == 2.0 and full["identical"] is None
    assert full["spread"]["tok_s"] == {"median": 2.0, "min": 1.0, "max": 4.0, "runs": 3}
    assert (vericache["tok_s"], vericache["vs_full"]) == (4.0, 2.0)
    assert vericache["p50_s"] == 1.0  # the median run's latencies
    assert vericache["identical"] == "1/2 (diverged at token 1)"
    assert lossy["identical"] == "1/2 (diverged at token 1)"
