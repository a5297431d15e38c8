"""`make gpu-check`'s CPU smoke mode: the script runs end to end at tiny shapes under
Triton's interpreter, so that on a GPU it never meets its first bug."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed")

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu_check.py"), *args],
        env={**env, "CUDA_VISIBLE_DEVICES": ""},  # the smoke mode, even on a GPU host
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_smoke_mode_checks_every_kernel_and_writes_its_report(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = _run("--smoke", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu (Triton interpreter)"
    assert report["kernel_id"].startswith("triton-")
    kinds = {row["kernel"] for row in report["identity"]}
    assert {
        "linear o_proj",
        "linear down_proj",
        "rms_norm",
        "rope",
        "attention spread rows",
    } <= kinds
    assert sum(kind.startswith("attention verify pass") for kind in kinds) == 1
    assert len([r for r in report["identity"] if r["kernel"] == "attention verify pass"]) == 5
    assert all(row["identical"] for row in report["identity"])
    errors = [row["rel_error"] for row in report["identity"] if row["rel_error"] is not None]
    assert errors and max(errors) < 1e-5  # fp32 arithmetic against float64
    assert "| attention spread rows | 5 | True |" in done.stdout


def test_without_a_gpu_the_full_check_refuses_with_exit_code_2(tmp_path):
    done = _run("--out", str(tmp_path / "x.json"))
    assert done.returncode == 2
    assert "no CUDA device here (use --smoke for the CPU check)" in done.stderr
