"""The automatic horizon follows measured acceptance and costs."""

from __future__ import annotations

from decoder.horizon import (
    PROBE_EVERY,
    PROBE_HORIZON,
    PROBE_MAX,
    START_HORIZON,
    Acceptance,
    Choice,
    CostModel,
    DraftYield,
    HorizonPolicy,
    guess_count,
)


def costs(draft_share: float, per_request: float, per_token: float) -> CostModel:
    model = CostModel()
    for _ in range(3):
        model.record_draft_step(draft_share * 4, 4)
    for requests, tokens in [(8, 72), (4, 132), (8, 264), (2, 10)]:
        model.record_verification(requests, tokens, per_request * requests + per_token * tokens)
    return model


def acceptance(rounds: list[tuple[int, int]]) -> Acceptance:
    record = Acceptance()
    for drafted, accepted in rounds:
        record.record(drafted, accepted)
    return record


def test_fit_recovers_per_request_and_per_token_costs():
    per_request, per_token = costs(0.02, 0.3, 0.015).verify_costs()
    assert abs(per_request - 0.3) < 1e-9 and abs(per_token - 0.015) < 1e-9


def test_fixed_horizon_is_fixed_and_auto_starts_at_the_default():
    assert HorizonPolicy(5).choose(Acceptance(), CostModel()) == Choice(5, "fixed")
    assert HorizonPolicy(None).choose(Acceptance(), CostModel()) == Choice(START_HORIZON, "start")


def test_high_acceptance_and_costly_verification_draft_long():
    good = acceptance([(16, 16)] * 6)
    assert HorizonPolicy(None, 32).choose(good, costs(0.02, 0.5, 0.015)).horizon >= 24


def test_low_acceptance_drafts_short():
    poor = acceptance([(8, 0), (8, 1), (8, 0), (8, 2)])
    assert HorizonPolicy(None, 32).choose(poor, costs(0.02, 0.5, 0.015)).horizon <= 3


def test_expensive_drafts_relative_to_verification_shorten_the_horizon():
    good = acceptance([(16, 12)] * 6)
    cheap = HorizonPolicy(None, 32).choose(good, costs(0.01, 0.5, 0.01)).horizon
    dear = HorizonPolicy(None, 32).choose(good, costs(0.2, 0.05, 0.01)).horizon
    assert dear < cheap


def test_acceptance_counts_trials_up_to_the_first_rejection():
    record = Acceptance(successes=0.0, trials=0.0, decay=1.0)
    record.record(drafted=10, accepted=3)  # 3 successes, then the 4th draft failed
    record.record(drafted=5, accepted=5)
    assert record.rate == 8 / 9


def test_a_request_that_stopped_drafting_is_probed_again():
    record = acceptance([(8, 0), (8, 0), (8, 0)])
    policy, model = HorizonPolicy(None, 32), costs(0.3, 0.5, 0.015)
    assert policy.choose(record, model).horizon == 0
    rounds = 0
    while policy.choose(record, model).horizon == 0:
        record.record(0, 0)
        rounds += 1
    assert 0 < rounds < 40


def test_drafts_that_come_several_per_forward_lengthen_the_horizon():
    """n-gram guesses confirmed by the drafter make each draft forward yield more drafts:
    the same acceptance and costs then pay for a longer round."""
    good = acceptance([(16, 12)] * 6)
    model = costs(0.05, 0.2, 0.01)
    one = HorizonPolicy(None, 32).choose(good, model, drafts_per_step=1.0).horizon
    four = HorizonPolicy(None, 32).choose(good, model, drafts_per_step=4.0).horizon
    assert four > one


def test_draft_yield_averages_drafts_per_forward():
    record = DraftYield()
    assert record.per_step == 1.0
    for _ in range(30):
        record.record(5)
    assert 4.9 < record.per_step <= 5.0
    record.record(0)  # a forward whose only draft ended the round still yields one
    assert record.per_step < 5.0


def test_the_choice_says_why_and_what_the_model_expects():
    good, poor = acceptance([(16, 16)] * 6), acceptance([(8, 0)] * 6)
    drafting = HorizonPolicy(None, 32).choose(good, costs(0.02, 0.5, 0.015))
    assert drafting.reason == "draft" and drafting.gain > 2
    exact = HorizonPolicy(None, 32).choose(poor, costs(0.6, 0.5, 0.015))
    assert exact == Choice(0, "exact", 1.0)


def test_a_model_that_keeps_choosing_exact_steps_still_probes_a_bounded_share():
    """Draft steps dearer than what any acceptance could repay: the model says exact steps
    whatever the record, so without probes nothing would be measured again. The first probe
    comes after PROBE_EVERY rounds without drafting, each probe the model does not follow
    doubles the wait, up to PROBE_MAX; a probe drafts PROBE_HORIZON tokens."""
    record, policy, model = Acceptance(), HorizonPolicy(None, 32), costs(5.0, 0.5, 0.015)
    waits, idle = [], 0
    while len(waits) < 6:
        choice = policy.choose(record, model)
        record.planned(choice, choice.horizon)  # as the planner does
        record.record(choice.horizon, 0)
        if choice.reason == "probe":
            assert choice.horizon == PROBE_HORIZON and choice.gain < 1
            waits.append(idle)
            idle = 0
        else:
            assert choice == Choice(0, "exact", 1.0)
            idle += 1
    assert waits == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, PROBE_MAX, PROBE_MAX, PROBE_MAX]


def test_drafting_by_the_models_choice_brings_probes_back_to_their_first_wait():
    """A probe that showed drafting pays (the model then chooses to draft) resets the wait:
    when the same request later falls back to exact steps, it probes after PROBE_EVERY."""
    record, policy = Acceptance(probe_after=PROBE_MAX), HorizonPolicy(None, 32)
    drafting = policy.choose(acceptance([(16, 16)] * 6), costs(0.02, 0.5, 0.015))
    record.planned(drafting, drafting.horizon)
    assert record.probe_after == PROBE_EVERY
    record.planned(Choice(PROBE_HORIZON, "probe", 0.9), 0)  # outvoted by its group: no probe
    assert record.probe_after == PROBE_EVERY
    record.planned(Choice(PROBE_HORIZON, "probe", 0.9), PROBE_HORIZON)
    assert record.probe_after == 2 * PROBE_EVERY


def draft_forwards(per_request: float, per_token: float) -> CostModel:
    """Draft forwards of 8 requests feeding 8 to 72 tokens, timed by the two costs."""
    model = CostModel()
    for tokens in (8, 72, 30, 50):
        model.record_draft_step(per_request * 8 + per_token * tokens, 8, tokens)
    return model


def test_draft_forwards_are_fitted_by_tokens_fed():
    per_request, per_token = draft_forwards(0.01, 0.004).fitted_draft()
    assert abs(per_request - 0.01) < 1e-9 and abs(per_token - 0.004) < 1e-9


def test_forwards_of_one_size_are_not_fitted():
    model = CostModel()
    for _ in range(5):
        model.record_draft_step(0.2, 4)
        model.record_verification(4, 4, 0.3)
    assert model.fitted_draft() is None and model.fitted_verify() is None
    assert model.verify_costs() == (0.5 * 1.5 / 20, 0.5 * 1.5 / 20)  # halves, for the horizon


def test_guesses_that_are_taken_and_cheap_to_check_are_fed_in_full():
    taken = acceptance([(8, 8)] * 6)
    memory_bound = draft_forwards(0.05, 0.0005).fitted_draft()  # a token costs 1% of a row
    assert guess_count(taken, memory_bound, 8) == 8


def test_guesses_cost_more_than_they_yield_in_a_compute_bound_forward():
    """At batch 8 on a CPU each fed token costs about a row's share: rarely taken guesses
    are not fed at all, and even good ones only a few at a time."""
    rare = acceptance([(8, 0), (8, 1), (8, 0), (8, 0)])
    compute_bound = draft_forwards(0.005, 0.01).fitted_draft()
    assert guess_count(rare, compute_bound, 8) == 0
    assert 0 < guess_count(acceptance([(8, 3)] * 6), compute_bound, 8) < 8


def test_unmeasured_costs_guess_the_limit_and_a_limit_of_zero_guesses_nothing():
    assert guess_count(Acceptance(), None, 5) == 5
    taken, memory_bound = acceptance([(8, 8)] * 6), draft_forwards(0.05, 0.0005).fitted_draft()
    assert guess_count(taken, memory_bound, 0) == 0


def test_a_request_that_stopped_guessing_guesses_again_as_its_record_relaxes():
    record = acceptance([(8, 0)] * 6)
    costs_ = draft_forwards(0.01, 0.004).fitted_draft()
    assert guess_count(record, costs_, 8) == 0
    for _ in range(30):
        record.record(0, 0)  # a forward that could have guessed, and did not
    assert guess_count(record, costs_, 8) > 0
