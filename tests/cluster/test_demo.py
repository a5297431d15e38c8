"""`vericache demo` as a user runs it (small): the local cluster, three tenants, the three
modes, and a table in which every VeriCache request is identical to full-KV decoding, and
the full row is the reference, never compared with itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

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
