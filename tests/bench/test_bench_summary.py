"""bench_summary's table: each VeriCache mode against its workload's full and lossy rows,
the ratio with the range its runs allow, and a verdict against the 0.97x target that
counts a miss as noise only within half the runs' spread, and calls any non-identical output
a failure whatever its speed. The rows come from the benches' own JSON shapes."""

from __future__ import annotations

import json

import pytest

from bench import bench_summary
from bench.bench_summary import Measured, rows_of
from bench.stats import Spread
from tests.bench.test_bench_remote import _compared, _row


def _runs(*values: float) -> Spread:
    ordered = sorted(values)
    return Spread(ordered[len(ordered) // 2], ordered[0], ordered[-1], len(ordered))


def _summary(full: Spread, vericache: Spread, identical: str = "4/4"):
    measured = [
        Measured("w", "full", full, None),
        Measured("w", "lossy", _runs(30.0, 30.0, 30.0), "1/4"),
        Measured("w", "vericache", vericache, identical, bound=1.5),
    ]
    (row,) = rows_of(measured)
    return row


def test_a_row_compares_medians_and_gives_the_range_the_runs_allow():
    row = _summary(_runs(9.0, 10.0, 11.0), _runs(11.0, 12.0, 13.0))
    assert row.vs_full == pytest.approx(1.2)
    assert row.vs_full_range == pytest.approx((11.0 / 11.0, 13.0 / 9.0))
    assert row.vs_lossy == pytest.approx(0.4)
    assert row.of_bound == pytest.approx(1.2 / 1.5)
    assert row.verdict == "meets"


@pytest.mark.parametrize(
    ("vericache", "verdict"),
    [
        (_runs(9.7, 9.7, 9.7), "meets"),  # 0.97x exactly
        (_runs(9.0, 9.5, 10.0), "noise"),  # 0.95x: 2% short, within half the runs' 10.5%
        (_runs(9.5, 9.5, 9.5), "below"),  # 0.95x, no spread on either side
        (_runs(8.0, 8.5, 9.0), "below"),  # 12% short, half the spread is 6%
        (_runs(7.0, 7.2, 10.0), "below"),  # one fast run does not make a 0.72x median noise
    ],
)
def test_the_verdict_holds_the_median_to_the_target_and_noise_only_within_half_the_spread(
    vericache, verdict
):
    assert _summary(_runs(10.0, 10.0, 10.0), vericache).verdict == verdict


def test_an_output_that_differs_from_full_kv_fails_however_fast():
    row = _summary(_runs(10.0), _runs(30.0), identical="3/4")
    assert not row.lossless and row.verdict == "NOT IDENTICAL"
    assert not _summary(_runs(10.0), _runs(30.0), identical="no (diverges at token 3)").lossless


def test_a_pinned_horizon_is_shown_but_not_judged_and_still_checked_for_identity():
    full = Measured("w", "full", _runs(10.0), None)

    def pinned(identical: str):
        measured = Measured("w", "vericache horizon 32", _runs(5.0), identical, judged=False)
        (row,) = rows_of([full, measured])
        return row

    assert (pinned("4/4").vs_full, pinned("4/4").verdict) == (0.5, "pinned, not judged")
    assert pinned("3/4").verdict == "NOT IDENTICAL"


def test_a_workload_without_a_full_row_has_no_summary_row():
    assert rows_of([Measured("w", "vericache", _runs(1.0), None)]) == []


def test_remote_and_cluster_rows_are_read_from_their_benches_json(tmp_path):
    rows = _compared(
        [
            _row("full", [[1, 2], [3, 4]], 10.0),
            _row("lossy", [[1, 2], [3, 5]], 20.0),
            _row("vericache", [[1, 2], [3, 4]], 15.0),
        ]
    )
    data = json.loads(json.dumps({"rows": rows}))  # as written to disk
    (remote,) = rows_of(bench_summary.from_remote(data))
    (cluster,) = rows_of(bench_summary.from_cluster(data))
    for row in (remote, cluster):
        assert (row.mode, row.identical, row.verdict) == ("vericache", "2/2", "meets")
        assert row.vs_full == pytest.approx(1.5) and row.vs_lossy == pytest.approx(0.75)
    assert remote.workload == "remote distinct: 2 requests, holds 2"
    assert cluster.workload == "cluster distinct: 2 requests over a 1Gbit/s link"


def test_the_table_lists_skipped_steps_and_the_results_reread(tmp_path, capsys):
    out = tmp_path / "summary.json"
    rows = _compared([_row("full", [[1]], 10.0), _row("vericache", [[1]], 9.0)])
    bench_summary.step_path(out, "remote").write_text(json.dumps({"rows": rows}))
    status = bench_summary.main(
        ["--from-results", "--steps", "remote", "cluster", "--out", str(out)]
    )
    table = capsys.readouterr().out
    assert status == 0
    assert "| vericache | 10.00 | 9.00 [9.00-9.00] | **0.90x** [0.90-0.90] |" in table
    assert "| below |" in table
    assert "| cluster | - | - | - | no results at" in table


def test_a_failure_the_run_recorded_is_shown_again_from_its_results(tmp_path, capsys):
    out = tmp_path / "summary.json"
    rows = _compared([_row("full", [[1]], 10.0), _row("vericache", [[1]], 10.0)])
    bench_summary.step_path(out, "remote").write_text(json.dumps({"rows": rows}))
    failed = "failed: exit status 1; its rows above are what it wrote"
    out.write_text(json.dumps({"rows": [], "skipped": {"remote": failed}}))
    status = bench_summary.main(["--from-results", "--steps", "remote", "--out", str(out)])
    table = capsys.readouterr().out
    assert status == 1
    assert "| meets |" in table and f"| remote | - | - | - | {failed} |" in table
