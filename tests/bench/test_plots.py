"""Benchmark plots (PNG beside the JSON) and progress bars (stderr, terminals only).

A short real `bench_local` run writes its JSON (which bench-summary reads) and its
figures; each figure function draws from synthetic rows and skips, saying why, when its
data is absent; progress bars appear only on a terminal or when forced, so logs and pipes
stay clean."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_summary, plots
from cluster.decoder_cli import _with_progress
from decoder import progress as progress_module

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BAR = re.compile(r"\r|\d+%\||\d+/\d+ \[")
"""What a tqdm bar leaves in a stream: carriage returns, `42%|`, `3/8 [`."""


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > 5_000, f"{path} is only {len(data)} bytes"


def quiet_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != progress_module.FORCE_ENV}
    return env | extra


def test_a_short_bench_local_run_writes_json_then_pngs_and_no_bar(tmp_path):
    out = tmp_path / "local.json"
    command = [
        sys.executable,
        "bench/bench_local.py",
        "--contexts", "512",
        "--batches", "1",
        "--max-new-tokens", "8",
        "--repeats", "1",
        "--compressors", "snapkv:budget=0.125",
        "--horizons", "2", "4",
        "--ngram", "0",
        "--threads", "2",
        "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env=quiet_env(), timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    horizons = [r["horizon"] for r in rows if r["mode"] == "vericache"]
    assert horizons == ["auto", 2, 4]
    assert all(sum(r["accepted_histogram"].values()) == r["verifications"] for r in rows[2:])
    # what bench-summary reads of it: each VeriCache row against full and lossy
    summary = bench_summary.rows_of(bench_summary.from_local(json.loads(out.read_text())))
    assert [r.mode for r in summary] == ["vericache", "vericache horizon 2", "vericache horizon 4"]
    assert all(r.identical == "1/1" and r.lossy is not None for r in summary)
    for suffix in ("horizon", "accepted"):
        png = tmp_path / f"local-{suffix}.png"
        assert_png(png)
        assert f"wrote {png}" in done.stdout
    assert not BAR.search(done.stderr), f"a progress bar on a non-terminal: {done.stderr!r}"


# ---- each figure from synthetic rows -----------------------------------------------------

LOCAL_ROWS = [
    {"context": 2048, "batch": 1, "mode": "full", "compressor": "-", "horizon": "-", "tok_s": 9.0},
    {"context": 2048, "batch": 1, "mode": "lossy", "compressor": "snapkv", "horizon": "-",
     "tok_s": 20.0},
    {"context": 2048, "batch": 1, "mode": "vericache", "compressor": "snapkv", "horizon": "auto",
     "tok_s": 14.0, "drafted": 60, "verifications": 10,
     "accepted_histogram": {"0": 2, "3": 5, "6": 3}},
    {"context": 2048, "batch": 1, "mode": "vericache", "compressor": "snapkv", "horizon": 8,
     "tok_s": 12.0, "accepted_histogram": {"1": 4, "8": 2}},
    {"context": 2048, "batch": 1, "mode": "vericache", "compressor": "snapkv", "horizon": 32,
     "tok_s": 10.0},
]  # fmt: skip


def remote_row(workload, mode, rate, budget=None, label="unlimited", **more) -> dict:
    return {"workload": workload, "mode": mode, "tokens_per_s": rate, "budget": budget,
            "budget_label": label, "wire_per_token": 4e6 if "pull" in mode else 2e5,
            **more}  # fmt: skip


REMOTE_ROWS = [
    remote_row("shared", "full", 30.0, ratio=1.0),
    remote_row("shared", "vericache@pull", 20.0, ratio=0.66,
               accepted_histogram={"0": 1, "2": 3}),
    *[remote_row("distinct", mode, rate * h, h * 2**28, f"full holds {h}")
      for h in (2, 4, 8) for mode, rate in (("full", 3.0), ("vericache@near", 4.0))],
]  # fmt: skip

CLUSTER_ROWS = [
    {"link": link, "link_bytes_per_s": speed, "workload": workload, "mode": mode,
     "ratio": ratio * (1 if speed is None else speed / 1.2e9) ** 0.1, "tokens_per_s": 10.0,
     "pulled_per_token": 3.9e6 if mode == "full" else 1e6}
    for link, speed in (("1.2GB/s", 1.2e9), ("1Gbit/s", 125e6), ("unshaped", None))
    for workload in ("shared", "distinct")
    for mode, ratio in (("full", 1.0), ("vericache@near", 1.3))
]  # fmt: skip

FIGURES = [
    (plots.tokens_per_s_vs_horizon, LOCAL_ROWS),
    (plots.accepted_histogram, LOCAL_ROWS),
    (plots.accepted_histogram, REMOTE_ROWS),
    (plots.budget_sweep, REMOTE_ROWS),
    (plots.bytes_per_token, REMOTE_ROWS),
    (plots.bytes_per_token, CLUSTER_ROWS),
    (plots.link_sweep, CLUSTER_ROWS),
]


@pytest.mark.parametrize(("figure", "rows"), FIGURES, ids=lambda f: getattr(f, "__name__", ""))
def test_each_figure_draws_a_png_from_its_rows(tmp_path, figure, rows):
    out = tmp_path / "results" / "x.png"
    assert figure(rows, out) == out
    assert_png(out)


ALL = [plots.tokens_per_s_vs_horizon, plots.accepted_histogram, plots.budget_sweep,
       plots.bytes_per_token, plots.link_sweep]  # fmt: skip
ABSENT = [
    [],
    [{}],
    [{"mode": "vericache"}],  # no rates, horizons, budgets, bytes or links
    [{"mode": "full", "tok_s": None, "tokens_per_s": "n/a", "budget": None, "ratio": None}],
]


@pytest.mark.parametrize("rows", ABSENT)
@pytest.mark.parametrize("figure", ALL, ids=lambda f: f.__name__)
def test_a_figure_without_its_data_is_skipped_and_says_so(tmp_path, capsys, figure, rows):
    out = tmp_path / "x.png"
    assert figure(rows, out) is None
    assert not out.exists()
    assert f"no {out.name}:" in capsys.readouterr().err


def test_figures_are_named_after_the_json_and_a_failing_one_is_reported(tmp_path, capsys):
    assert plots.png_path(Path("r/remote.json"), "budget") == Path("r/remote-budget.png")

    def broken(rows, out):
        raise ValueError("bad row")

    written = plots.write_figures(
        tmp_path / "remote.json",
        [("broken", broken, []), ("budget", plots.budget_sweep, REMOTE_ROWS)],
    )
    assert written == [tmp_path / "remote-budget.png"]
    captured = capsys.readouterr()
    assert "plot remote-broken.png failed: ValueError: bad row" in captured.err
    assert f"wrote {tmp_path / 'remote-budget.png'}" in captured.out


def test_histograms_are_summed_over_requests():
    merged = plots.merged_histogram([{"0": 1, "3": 2}, {"3": 1, "10": 4}, {}])
    assert merged == {"0": 1, "3": 3, "10": 4}
    assert list(merged) == ["0", "3", "10"]


# ---- progress ----------------------------------------------------------------------------


def test_bars_show_only_on_a_terminal_unless_forced(capsys, monkeypatch):
    monkeypatch.delenv(progress_module.FORCE_ENV, raising=False)
    assert progress_module.enabled() is None  # tqdm: on when stderr is a TTY
    list(progress_module.progress(range(3), desc="quiet"))
    assert capsys.readouterr().err == ""  # captured stderr is no terminal
    monkeypatch.setenv(progress_module.FORCE_ENV, "1")
    list(progress_module.progress(range(3), desc="forced"))
    assert "forced" in capsys.readouterr().err
    monkeypatch.setenv(progress_module.FORCE_ENV, "0")
    assert progress_module.enabled() is True


def test_publish_progress_reports_tokens_and_bytes_only_when_shown(capsys, monkeypatch):
    class Reply:
        tokens, stored_bytes = 4096, 3 * 2**20

    monkeypatch.delenv(progress_module.FORCE_ENV, raising=False)
    assert _with_progress("publishing big.py", Reply) is not None
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(progress_module.FORCE_ENV, "1")
    assert isinstance(_with_progress("publishing big.py", Reply), Reply)
    err = capsys.readouterr().err
    assert "publishing big.py" in err and "4096 tokens prefilled, 3.0 MiB stored" in err

    def refused():
        raise PermissionError("not a member")

    with pytest.raises(PermissionError, match="not a member"):
        _with_progress("publishing big.py", refused)


def test_the_loaders_hashing_bar_is_absent_on_a_pipe_and_present_when_forced(tmp_path):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"\0" * (1 << 20))
    script = "import sys, pathlib; from decoder.loader import _file_digest as d; " \
             "print(d(pathlib.Path(sys.argv[1])))"  # fmt: skip
    for forced in ("", "1"):
        (tmp_path / ".vericache-fingerprint.json").unlink(missing_ok=True)
        env = quiet_env(**({progress_module.FORCE_ENV: forced} if forced else {}))
        done = subprocess.run(
            [sys.executable, "-c", script, str(weights)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert len(done.stdout.strip()) == 64
        shown = "hashing w.safetensors" in done.stderr
        assert shown == bool(forced), done.stderr
