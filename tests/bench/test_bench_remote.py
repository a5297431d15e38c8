"""bench_remote's and bench_cluster's rows: the full-KV row is the reference, never compared
with itself ("reference" in the table, null "identical" in the JSON); every other row says
how many requests equal it."""

from __future__ import annotations

import json

from bench import bench_cluster, bench_remote
from bench.stats import spreads, spreads_json


def _row(mode: str, tokens: list[list[int]], tok_s: float) -> dict:
    """A measured row as `bench_remote._measure` returns it (one run)."""
    run = {
        "tokens_per_s": tok_s,
        "p50_s": 1.0,
        "p95_s": 2.0,
        "accepted_per_verification": 3.0,
        "acceptance": 0.5,
        "drafts_per_draft_step": 1.0,
        "wire_per_token": 2e6,
        "near_passes": 0,
        "near_wire_per_pass_s": 0.0,
        "near_shard_per_pass_s": 0.0,
        "peak_kv_bytes": 4e8,
        "full_step_s": 0.05,
        "draft_step_s": 0.01,
        "fetch_stall_s": 0.0,
        "fetch_s": 0.0,
    }
    row = dict(run, spread=spreads_json(spreads([run], run)), runs=1, mode=mode, tokens=tokens)
    return row | {"workload": "distinct", "budget_label": "holds 2", "link": "1Gbit/s"}


def _compared(rows: list[dict]) -> list[dict]:
    """The rows after `_finish_row`, as the benches' loops call it."""
    reference = None
    for row in rows:
        reference = row if row["mode"] == "full" else reference
        bench_remote._finish_row(row, reference)
        bench_cluster.add_pull_columns(row)
    return rows


def test_the_full_row_is_the_reference_not_a_comparison_with_itself():
    full, lossy, vericache = _compared(
        [
            _row("full", [[1, 2], [3, 4]], 10.0),
            _row("lossy", [[1, 2], [3, 5]], 20.0),
            _row("vericache", [[1, 2], [3, 4]], 15.0),
        ]
    )
    assert full["identical"] is None and full["ratio"] == 1.0
    assert json.loads(json.dumps(full))["identical"] is None  # null in the results file
    assert (lossy["identical"], vericache["identical"]) == ("1/2", "2/2")
    for fmt in (bench_remote._fmt_row, bench_cluster.fmt_row):
        assert [fmt(r).split()[-1] for r in (full, lossy, vericache)] == [
            "reference",
            "1/2",
            "2/2",
        ]


def test_rows_without_a_full_row_are_not_called_the_reference():
    (vericache,) = _compared([_row("vericache", [[1, 2]], 15.0)])
    assert vericache["identical"] is None and vericache["ratio"] is None
    assert bench_remote._fmt_row(vericache).split()[-1] == "-"
