"""The benches' median and spread (bench/stats.py), and how the benches report them: a figure
is the median of its runs with their range, in the table and in the JSON; bench_footprint
fails when its two generate rows disagree on the tokens."""

from __future__ import annotations

import json

import pytest

from bench import bench_attention, bench_decode, bench_footprint
from bench.stats import DEFAULT_REPEATS, Spread, row_text, spread, spreads, spreads_json


def test_a_spread_is_the_median_and_range_of_the_runs():
    assert spread([3.0, 1.0, 2.0]) == Spread(median=2.0, low=1.0, high=3.0, runs=3)
    assert spread([4, 1, 2, 3]) == Spread(median=2.5, low=1.0, high=4.0, runs=4)
    assert spread([5.0]) == Spread(5.0, 5.0, 5.0, 1)
    assert spread(x for x in (2.0, 2.0)).runs == 2  # any iterable, read once


def test_no_runs_is_an_error_not_a_figure():
    with pytest.raises(ValueError, match="no runs"):
        spread([])


def test_a_spread_prints_as_median_and_range_and_survives_json():
    figure = spread([12.31, 11.9, 12.8])
    assert figure.text() == "12.31 [11.90-12.80]"
    assert figure.text(".1f") == "12.3 [11.9-12.8]"
    assert figure.range_text(".0f") == "12-13"
    assert figure.scaled(1e3).text(".0f") == "12310 [11900-12800]"
    data = json.loads(json.dumps(figure.to_json()))
    assert data == {"median": 12.31, "min": 11.9, "max": 12.8, "runs": 3}
    assert Spread.from_json(data) == figure


def test_a_result_row_keeps_each_figures_spread_for_its_table():
    runs = [{"tok_s": 10.0, "wall_s": 3.0}, {"tok_s": 12.0, "wall_s": 2.5}, {"tok_s": 11.0}]
    with pytest.raises(KeyError):  # every run must have the figure
        spreads(runs, ["wall_s"])
    figures = spreads(runs, ["tok_s"])
    row = {"tok_s": figures["tok_s"].median, "spread": spreads_json(figures)}
    row = json.loads(json.dumps(row))
    assert row_text(row, "tok_s") == "11.00 [10.00-12.00]"
    assert row_text(row, "tok_s", ".0f", factor=1e3) == "11000 [10000-12000]"


def test_benches_default_to_at_least_three_runs():
    assert DEFAULT_REPEATS >= 3


def test_bench_attention_rows_give_medians_their_ratio_and_ranges():
    row = bench_attention.timed_row({"torch": [0.004, 0.002, 0.003], "fused": [0.001] * 3}, 1)
    assert (row["torch_ms"], row["fused_ms"], row["speedup"]) == (3.0, 1.0, 3.0)
    assert row_text(row, "torch_ms", ".1f") == "3.0 [2.0-4.0]"


def test_bench_decode_rows_give_per_token_ranges():
    step = {"exact": spread([0.04, 0.05, 0.06]), "fast": spread([0.02] * 3)}
    step["transformers"] = spread([0.08, 0.1, 0.12])
    row = bench_decode.decode_row(512, 2, step, {"fp16": spread([0.01, 0.02, 0.03])})
    assert row["exact_ms_per_token"] == 25.0 and row["exact_vs_transformers"] == 2.0
    assert row_text(row, "exact_ms_per_token", ".0f") == "25 [20-30]"
    assert row_text(row, "draft_fp16_ms_per_token", ".0f") == "10 [5-15]"
    assert "median [min-max] of 3 runs" in bench_decode._table([row])


def run_of(tokens: list[int], wall_s: float = 1.0, rss: int = 10**9) -> bench_footprint.Run:
    """A generate run that printed `tokens` (after other output) as its last line."""
    return bench_footprint.Run(wall_s, rss, "loading\n" + json.dumps({"tokens": tokens}) + "\n")


def test_bench_footprint_passes_only_when_every_generate_gives_the_same_tokens():
    same = {name: [run_of([1, 2, 3])] * 2 for name in bench_footprint.GENERATES}
    assert bench_footprint.token_mismatch(same) is None
    differs = dict(same, **{"transformers generate": [run_of([1, 2, 3]), run_of([1, 9, 3])]})
    message = bench_footprint.token_mismatch(differs)
    assert message.startswith("transformers generate run 1 generated different tokens")
    assert "token 1" in message
    short = dict(same, **{"transformers generate": [run_of([1, 2])]})
    assert "2 tokens, not 3" in bench_footprint.token_mismatch(short)
    silent = dict(same, **{"transformers generate": [bench_footprint.Run(1.0, 1, "")]})
    assert bench_footprint.token_mismatch(silent) is not None  # printed nothing: no pass


def test_bench_footprint_rows_give_medians_and_ranges():
    runs = [run_of([1], wall_s=w, rss=r) for w, r in ((2.0, 3e8), (1.0, 1e8), (3.0, 2e8))]
    row = bench_footprint.summary_row("vericache generate", runs)
    assert (row["wall_s"], row["peak_rss_bytes"]) == (2.0, 2e8)
    assert row_text(row, "peak_rss_bytes", ".0f", 1e-6) == "200 [100-300]"
    assert len(row["runs"]) == 3
