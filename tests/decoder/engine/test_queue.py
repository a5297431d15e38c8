"""The admission queue's fairness, model-free: tenants in turn, bounded bypass, no
starvation, first come first served at max_bypass=0."""

from __future__ import annotations

import pytest

from decoder.engine.queue import FairQueue


def queue_of(*items: tuple[str, str], **kwargs) -> FairQueue[str]:
    q: FairQueue[str] = FairQueue(**kwargs)
    for item, tenant in items:
        q.push(item, tenant)
    return q


def test_tenants_take_turns_each_in_arrival_order():
    q = queue_of(("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("c1", "C"), ("b2", "B"))
    assert q.candidates() == ["a1", "b1", "c1", "a2", "b2", "a3"]
    q.admitted("a1")  # A goes to the back of the round
    assert q.candidates() == ["b1", "c1", "a2", "b2", "a3"]
    q.admitted("b1")
    assert q.candidates() == ["c1", "a2", "b2", "a3"]
    assert q.items() == ["a2", "a3", "c1", "b2"]


def test_a_burst_of_one_tenant_does_not_delay_another_beyond_one_round():
    q = queue_of(*[(f"a{i}", "A") for i in range(50)], ("b", "B"), lookahead=4)
    assert q.candidates() == ["a0", "b", "a1", "a2"]


def test_a_refused_item_is_passed_at_most_max_bypass_times_then_waits_alone():
    q = queue_of(("big", "A"), ("s1", "A"), ("s2", "B"), ("s3", "C"), max_bypass=2)
    q.refused("big")
    q.admitted("s1")
    assert not q.blocked() and q.candidates() == ["s2", "s3", "big"]  # A had its turn
    q.refused("big")
    q.admitted("s2")
    assert q.blocked() and q.candidates() == ["big"]  # nothing else until it fits
    q.admitted("big")
    assert not q.blocked() and q.candidates() == ["s3"]


def test_only_admissions_past_it_count_as_bypasses():
    q = queue_of(("early", "A"), ("big", "B"), ("late", "C"), max_bypass=1)
    q.refused("big")
    q.admitted("early")  # arrived before it: not a bypass
    assert not q.blocked()
    q.admitted("late")
    assert q.blocked() and q.candidates() == ["big"]


def test_max_bypass_zero_is_first_come_first_served():
    q = queue_of(("x", "A"), ("y", "B"), max_bypass=0)
    assert q.candidates() == ["x"]
    q.admitted("x")
    assert q.candidates() == ["y"]


def test_removal_and_validation():
    q = queue_of(("x", "A"), ("y", "A"), ("z", "B"))
    assert q.remove_if(lambda item: item != "y") == ["x", "z"]
    assert len(q) == 1 and q.candidates() == ["y"]
    q.remove("y")
    assert len(q) == 0 and q.candidates() == []
    with pytest.raises(ValueError):
        FairQueue(max_bypass=-1)
