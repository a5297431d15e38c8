"""FairShare: weighted shares over the active tenants plus one newcomer, the newcomer's room
kept free, release, and counts that stay exact under threads."""

from __future__ import annotations

import threading

import pytest

from prefix_store.errors import LimitExceeded
from prefix_store.shares import FairShare, Reserved, check_weight


def fill(share: FairShare, tenant: str, weight: float | None = None) -> int:
    """Acquire one unit at a time until refused; how many were taken."""
    taken = 0
    while True:
        try:
            share.acquire(tenant, weight=weight)
        except LimitExceeded:
            return taken
        taken += 1


def interleave(share: FairShare, tenants: dict[str, float]) -> dict[str, int]:
    """Tenants asking one unit each in turn until all are refused (contention)."""
    taken = dict.fromkeys(tenants, 0)
    going = set(tenants)
    while going:
        for tenant in sorted(going):
            try:
                share.acquire(tenant, weight=tenants[tenant])
                taken[tenant] += 1
            except LimitExceeded:
                going.discard(tenant)
    return taken


def test_a_tenant_alone_gets_the_capacity_less_a_newcomers_share():
    share = FairShare(28, "call slots")
    assert fill(share, "a") == 14
    with pytest.raises(LimitExceeded, match=r"'a': 14 call slots held.*fair share is 14 of 28"):
        share.acquire("a")
    assert share.held("a") == 14 and share.held() == 14


def test_a_newcomer_always_finds_room_while_others_hold_all_they_can():
    share = FairShare(28, "call slots")
    hogs = [fill(share, "a"), fill(share, "b"), fill(share, "c")]
    assert all(hogs) and share.held() < 28
    for newcomer in ("d", "e", "f"):
        share.acquire(newcomer)  # each finds its first unit
    assert share.held() <= 28


def test_weights_divide_the_capacity_under_contention():
    share = FairShare(30, "call slots")
    taken = interleave(share, {"heavy": 2.0, "light": 1.0})
    assert taken == {"heavy": 15, "light": 7}  # 30 * 2/4 and 30 * 1/4: about twice
    assert share.held() == 22  # a newcomer's 30/4 stays free


def test_weights_come_from_the_callable_when_not_given():
    share = FairShare(30, "tickets", weight={"heavy": 2.0}.get)
    assert fill(share, "heavy") == 20  # 30 * 2/3
    share = FairShare(30, "tickets", weight={"heavy": 2.0}.get)
    assert fill(share, "other") == 15  # no valid weight (None): the default, 1.0


def test_release_gives_room_back_and_forgets_idle_tenants():
    share = FairShare(10, "tickets")
    assert fill(share, "a") == 5
    share.release("a", 2)
    assert share.held("a") == 3 and share.active() == 1
    share.release("a", 99)  # never below zero
    assert share.held("a") == 0 and share.active() == 0 and share.held() == 0
    assert fill(share, "a") == 5  # its share is whole again


def test_hold_releases_even_on_failure():
    share = FairShare(4, "leases")
    with pytest.raises(RuntimeError), share.hold("a", 2):
        assert share.held("a") == 2
        raise RuntimeError
    assert share.held() == 0


def test_amounts_in_bytes_are_bounded_by_share():
    share = FairShare(1000, "receive bytes")
    share.acquire("a", 400)
    with pytest.raises(LimitExceeded, match="receive bytes"):
        share.acquire("a", 101)  # alone: 500
    share.acquire("b", 300)  # b's share is 1000/3 when a is active
    with pytest.raises(LimitExceeded, match="'b'"):
        share.acquire("b", 34)


def test_the_capacity_itself_is_never_exceeded():
    share = FairShare(3, "slots")
    for tenant in "abcdef":
        try:
            share.acquire(tenant)
        except LimitExceeded as error:
            assert "server busy: 3 of 3 slots held" in str(error)
    assert share.held() == 3


def test_a_tiny_capacity_still_admits_one():
    share = FairShare(1, "Attend streams")
    share.acquire("a")  # share 0.5, but one unit is always a tenant's least
    with pytest.raises(LimitExceeded):
        share.acquire("b")


def test_counts_stay_exact_under_threads():
    share = FairShare(64, "slots", weight=lambda t: 1.0 + int(t[1:]) % 3)
    errors: list[BaseException] = []

    def churn(tenant: str) -> None:
        try:
            for _ in range(2000):
                try:
                    share.acquire(tenant)
                except LimitExceeded:
                    continue
                assert share.held() <= 64
                share.release(tenant)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=churn, args=(f"t{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert share.held() == 0 and share.active() == 0


def test_weights_must_be_finite_and_positive():
    assert check_weight(2) == 2.0
    for bad in (0, -1, float("inf"), float("nan"), "2"):
        with pytest.raises(ValueError, match="finite number > 0"):
            check_weight(bad)


def test_the_reserved_pool_is_first_come_first_served():
    pool = Reserved(2, "admin call slots")
    assert pool.try_acquire() and pool.try_acquire() and not pool.try_acquire()
    pool.release()
    assert pool.held() == 1 and pool.try_acquire()
