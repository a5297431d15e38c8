"""Whether a new prefix group drafts, or is served as full-KV decoding would serve it
(`RoundPlanner.drafts`): its own horizon, the engine's, else the policy's choices for the
requests in flight under the measured costs."""

from __future__ import annotations

from types import SimpleNamespace

from decoder.engine.planner import RoundPlanner
from decoder.engine.stats import EngineStats
from decoder.horizon import PROBE_EVERY, Acceptance, CostModel, HorizonPolicy
from decoder.staging import RingStats
from tests.decoder.test_horizon import costs


def planner(horizon=None, model=None) -> RoundPlanner:
    policy = HorizonPolicy(horizon, 32)
    return RoundPlanner(policy, model or costs(0.02, 0.5, 0.015), None, RingStats(), EngineStats())


def request(horizon=None):
    return SimpleNamespace(horizon=horizon)  # all `drafts` reads of a request


def in_flight(*records: Acceptance) -> list:
    return [SimpleNamespace(acceptance=a, done=False) for a in records]


def good() -> Acceptance:
    record = Acceptance()
    for _ in range(6):
        record.record(16, 16)
    return record


def test_a_horizon_given_decides():
    assert planner().drafts(request(4), []) and not planner().drafts(request(0), [])
    assert not planner(horizon=0).drafts(request(), [])
    assert planner(horizon=0).drafts(request(8), [])  # the request's own first


def test_nothing_measured_drafts():
    assert planner(model=CostModel()).drafts(request(), [])


def test_the_requests_in_flight_decide_under_the_measured_costs():
    cheap, dear = costs(0.02, 0.5, 0.015), costs(5.0, 0.5, 0.015)
    assert planner(model=cheap).drafts(request(), in_flight(good(), good()))
    assert not planner(model=dear).drafts(request(), in_flight(good(), good()))
    assert planner(model=cheap).drafts(request(), [])  # the prior acceptance: drafting pays


def test_requests_only_probing_do_not_count_as_drafting():
    idle = Acceptance(idle=PROBE_EVERY)
    assert not planner(model=costs(5.0, 0.5, 0.015)).drafts(request(), in_flight(idle, idle))
