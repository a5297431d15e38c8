"""The checks behind `make load` and `make chaos` fail when what they claim did not happen:
each is fed a sabotaged input (a fault that did nothing, zero detections, a shard that
answers NOT_FOUND for a committed prefix, nothing verified or checked, an unexpected status)
and must report it; the clean input passes. The NOT_FOUND case runs against a real shard."""

from __future__ import annotations

import copy
import random
from collections import deque

import pytest

from bench.chaos import FAULTS, FaultRun, fault_problems, fault_result, print_table, selected
from bench.chaos import verdict as chaos_verdict
from bench.load import Losses, Reads, Tenant
from bench.load import verdict as load_verdict
from prefix_store.client import StoreClient
from prefix_store.config import ClientConfig, ShardConfig

OPS = ("publish", "lookup", "fetch", "generate")


def clean_load() -> dict:
    row = {"count": 10, "ok": 10, "misses": 0, "errors": {}}
    return {
        "operations": {op: dict(row) for op in OPS},
        "verified_bytes": 4096,
        "lost_bytes": 0,
        "misses": 0,
        "errors": {},
        "losses": {"missed_prefixes": 0, "explanations": {}, "unexplained": 0},
        "tokens": {"checked": 5, "wrong_tokens": 0, "wrong_at": [], "prompts": 2},
    }


def sabotaged(change) -> dict:
    summary = copy.deepcopy(clean_load())
    change(summary)
    return summary


def test_a_clean_load_passes():
    assert load_verdict(clean_load()) == []


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (lambda s: s.update(lost_bytes=64), "64 bytes read back wrong"),
        (lambda s: s.update(verified_bytes=0), "no byte was read back and verified"),
        (lambda s: s["tokens"].update(wrong_tokens=3), "3 wrong tokens"),
        (lambda s: s["tokens"].update(checked=0), "no lossless generation was checked"),
        (
            lambda s: s["losses"].update(missed_prefixes=2, unexplained=1),
            "1 of 2 committed prefixes missed with nothing to explain it",
        ),
        (lambda s: s["errors"].update({"exception:KeyError": 1}), "with an exception (a bug)"),
        (lambda s: s["errors"].update({"UNAVAILABLE": 4}), "operations failed: {'UNAVAILABLE': 4}"),
        (lambda s: s["operations"]["fetch"].update(ok=0), "fetch: none of 10 succeeded"),
    ],
    ids=["lost", "unverified", "wrong", "unchecked", "unexplained", "bug", "status", "no-ok"],
)
def test_a_sabotaged_load_fails(change, complaint):
    problems = load_verdict(sabotaged(change))
    assert any(complaint in p for p in problems), problems


def test_expected_statuses_are_not_failures():
    summary = sabotaged(lambda s: s["errors"].update({"RESOURCE_EXHAUSTED": 2}))
    assert load_verdict(summary, expected_errors={"RESOURCE_EXHAUSTED"}) == []


def test_losses_explain_at_most_one_missed_prefix_each():
    losses = Losses()
    losses.miss("a", 1)
    losses.miss("a", 1)  # the same prefix again
    losses.miss("b", 2)
    assert losses.figures()["unexplained"] == 2
    losses.explain("dropped", 1)
    losses.explain("lost_spills", 0)
    assert losses.figures() == {
        "missed_prefixes": 2,
        "explanations": {"dropped": 1},
        "unexplained": 1,
    }


# ---- chaos --------------------------------------------------------------------------------


def figures(**overrides) -> dict:
    base = {"operations": 40, "errors": 0, "by_status": {}, "misses": 0, "generate_errors": 0,
            "missing_replicas": 0, "lost_bytes": 0, "checked_generations": 3,
            "near_generations": 0, "near_retries": 0, "wrong_generations": 0,
            "samples": {}}  # fmt: skip
    return base | overrides


def row(name: str, measured: dict, events: dict | None = None, **window) -> dict:
    run = FaultRun(FAULTS[name], 0.0, 5.0, measured, events or {})
    return fault_result(run, figures(**window))


def test_a_fault_with_its_evidence_passes_and_says_what_was_measured():
    r = row("disk-corrupt", {"flipped": 8, "detected": 3}, {"failover.DataLoss": 2})
    assert fault_problems(r) == []
    assert r["observed"].startswith("8 blobs flipped on shard-1's disk; 3 detected")
    assert "2 fetches went on from the replica" in r["observed"]


@pytest.mark.parametrize(
    ("name", "measured", "events", "window", "complaint"),
    [
        ("disk-corrupt", {"flipped": 8, "detected": 0}, {}, {}, "(detected: 0)"),
        ("disk-corrupt", {"flipped": 0, "detected": 0}, {}, {}, "(flipped: 0)"),
        ("transit-corrupt", {"corrupted": 8}, {}, {}, "(transit_detected: 0)"),
        ("shard-kill-fetch", {"in_memory": 3}, {}, {}, "(failovers or unreachable or errors: 0)"),
        ("decoder-kill", {"in_flight": 0}, {}, {"errors": 2}, "(in_flight: 0)"),
        ("decoder-kill", {"in_flight": 2}, {}, {}, "(generate_errors: 0)"),
        ("redis-restart", {"restarted": 0}, {}, {"errors": 9}, "(restarted: 0)"),
        ("disk-full", {"disk_write_errors": 0}, {}, {}, "(disk_write_errors: 0)"),
        ("attend-corrupt", {"corrupted_partials": 0}, {}, {}, "(corrupted_partials: 0)"),
        (
            "shard-stop",
            {},
            {"unreachable": 2},
            {"errors": 1, "by_status": {"PERMISSION_DENIED": 1}},
            "statuses it does not expect: {'PERMISSION_DENIED': 1}",
        ),
        (
            "disk-corrupt",
            {"flipped": 8, "detected": 8},
            {},
            {"errors": 1, "by_status": {"NOT_FOUND": 1}},
            "statuses it does not expect: {'NOT_FOUND': 1}",
        ),
    ],
    ids=[
        "undetected",
        "nothing-flipped",
        "transit-unseen",
        "unfelt-kill",
        "idle-decoder",
        "no-failure",
        "no-restart",
        "disk-not-full",
        "attend-unfelt",
        "status",
        "miss-as-error",
    ],  # fmt: skip
)
def test_a_fault_that_did_not_prove_itself_fails(name, measured, events, window, complaint):
    problems = fault_problems(row(name, measured, events, **window))
    assert any(complaint in p for p in problems), problems


def test_a_window_failing_with_a_status_it_does_not_expect_prints_what_failed(capsys):
    """The verdict fails on the status; the table says which operation failed, and why."""
    samples = {"INTERNAL": ["generate: StoreError: internal error (request id 1)"]}
    window = {"errors": 1, "by_status": {"INTERNAL": 1}, "samples": samples}
    r = row("shard-kill-put", {"missing_replicas": 3}, {}, **window)
    assert any("{'INTERNAL': 1}" in p for p in fault_problems(r))
    print_table({"faults": [r]})
    assert (
        "INTERNAL: generate: StoreError: internal error (request id 1)" in capsys.readouterr().out
    )


def test_near_data_faults_run_only_where_decoders_verify_near_the_data():
    """Without near placement no decoder attends, so attend-corrupt could prove nothing."""
    assert "attend-corrupt" not in [f.name for f in selected(["attend-corrupt"], "auto")]
    assert [f.name for f in selected(["attend-corrupt"], "near")] == ["attend-corrupt"]


def test_a_fault_whose_repair_failed_or_never_recovered_fails():
    run = FaultRun(FAULTS["shard-stop"], 0.0, None, {}, {"unreachable": 4}, "OSError: gone")
    problems = fault_problems(fault_result(run, figures()))
    assert any("repair failed: OSError: gone" in p for p in problems)
    assert any("not healthy within" in p for p in problems)


def clean_chaos() -> dict:
    good = row("shard-kill-fetch", {"in_memory": 3}, {"failover.Unavailable": 5})
    return clean_load() | {
        "faults": [good],
        "calm": figures(),
        "accounting": {"shard-0": (100, 100)},
    }


def test_a_clean_chaos_run_passes_and_its_checks_fail_when_sabotaged():
    assert chaos_verdict(clean_chaos()) == []
    result = clean_chaos()
    result["accounting"]["shard-1"] = (100, 90)
    result["calm"] = figures(errors=1, by_status={"UNAVAILABLE": 1})
    result["tokens"]["checked"] = 0
    problems = chaos_verdict(result)
    assert any("holds 100 bytes but charges 90" in p for p in problems)
    assert any("before any fault, operations failed" in p for p in problems)
    assert any("no lossless generation was checked" in p for p in problems)


# ---- a real shard answering NOT_FOUND for a committed prefix ------------------------------


@pytest.fixture
def shard(metadata, redis_server, tmp_path):
    from prefix_store.server import ShardServer

    config = ShardConfig(shard_id="shard-0", disk_dir=tmp_path / "shard-0", heartbeat_s=0.2)
    server = ShardServer(config, redis_server.url)
    server.start()
    yield server
    server.stop(0)


def test_a_committed_prefix_the_shard_no_longer_has_is_an_unexplained_loss(shard, metadata):
    token = metadata.add_tenant("alice")
    config = ClientConfig(timeout_s=10, stream_timeout_s=30, retries=1)
    with StoreClient([shard.address], token, config) as store:
        tenant = Tenant("alice", token, store, deque(maxlen=3), prompts=[])
        losses = Losses()
        reads = Reads(chunks=2, losses=losses)
        rng = random.Random(0)
        kept, gone = rng.getrandbits(62), rng.getrandbits(62)
        for seed in (kept, gone):
            reads.publish(tenant, seed, fresh=True)
        assert reads.verify(tenant, kept).verified_bytes > 0
        assert not reads.verify(tenant, gone).missed and losses.figures()["unexplained"] == 0
        from bench.load import LAYOUT, prefix_of

        store.delete_prefix(prefix_of(gone, 2)[0], LAYOUT)  # behind the workload's back
        assert reads.verify(tenant, gone).missed
        assert reads.lookup(tenant, gone).missed
        assert reads.verify(tenant, kept).verified_bytes > 0
    summary = clean_load() | {"losses": losses.figures()}
    assert any("nothing to explain it" in p for p in load_verdict(summary))
