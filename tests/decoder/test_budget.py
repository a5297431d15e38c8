"""The KV budget: reservations, and bytes held only because there was room given back."""

from __future__ import annotations

import pytest

from decoder.budget import KVBudget


class Holder:
    """Holds `copies` opportunistic reservations of `size` bytes (resident prefixes)."""

    def __init__(self, budget: KVBudget, copies: int, size: int) -> None:
        self.budget, self.size = budget, size
        self.held = [size] * copies
        for _ in range(copies):
            assert budget.try_reserve(size, reclaim=False)
        budget.add_reclaimer(self.give_one)

    def give_one(self) -> bool:
        if not self.held:
            return False
        self.budget.release(self.held.pop())
        return True


def test_a_reservation_that_does_not_fit_takes_back_only_what_it_needs():
    budget = KVBudget(100)
    holder = Holder(budget, copies=3, size=30)  # 90 of 100 held opportunistically
    assert budget.try_reserve(25)  # needs one copy back, not all three
    assert len(holder.held) == 2 and budget.used == 85


def test_without_reclaiming_or_with_nothing_left_it_fails_and_reserves_nothing():
    budget = KVBudget(100)
    holder = Holder(budget, copies=2, size=40)
    assert not budget.try_reserve(30, reclaim=False)
    assert budget.used == 80 and len(holder.held) == 2
    assert not budget.try_reserve(101)  # more than the whole budget: all given back, no use
    assert budget.used == 0 and not holder.held


def test_an_unconditional_reservation_over_the_limit_reclaims_until_under_it():
    budget = KVBudget(100)
    holder = Holder(budget, copies=3, size=30)
    budget.reserve(45)  # 135: two copies go back (one leaves 105)
    assert budget.used == 75 and len(holder.held) == 1


@pytest.mark.parametrize("limit", [0, -5])
def test_a_budget_must_be_positive(limit):
    with pytest.raises(ValueError, match="kv budget must be > 0 bytes"):
        KVBudget(limit)
