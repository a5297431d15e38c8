"""Fair shares: one bounded resource (call slots, tickets, leases, connections, bytes)
divided among the tenants using it, in proportion to their weights, so that no tenant
can starve another. Every server's bound on what a tenant holds goes through `FairShare`.

The rule. `capacity` units are shared. Let W be the sum of the weights of the tenants
active now (holding at least one unit), counting the asking tenant t (weight w) even if it
holds nothing yet, plus 1.0 for one newcomer of default weight. Then t may acquire
`amount` units when all of these hold:

  1. held(t) + amount <= max(1, capacity * w / W)   -- its weighted share (at least 1)
  2. total held + amount <= capacity                -- the capacity itself
  3. if t already holds something:
     total held + amount <= capacity - capacity * 1.0 / W
                                                    -- a newcomer's share stays free

and, when the share has a `limit`, held(t) + amount <= limit whatever the share.
So a tenant alone may use the capacity less the newcomer's share (half of it at weight
1.0), two tenants of weight 1.0 a third each, and so on; a tenant of weight 2 gets twice
the share of one of weight 1. Rule 3 keeps a newcomer's room free even when tenants hold
more than their current share (they took it before others came: they keep it, but get
nothing more until they are back under it), so a tenant that holds nothing finds room as
long as fewer tenants are active than there are units. Shares adapt as tenants come and
go; nothing is taken back from a holder. A refusal is `LimitExceeded` naming `what`, the
tenant's share and the capacity (RESOURCE_EXHAUSTED, with `retry-after-ms`).

A tenant's weight is read (from `weight`, or given to `acquire`) when it becomes active
and kept while it holds anything, so the running sum W needs no scan: every call is O(1).
`FairShare` is thread-safe: one lock guards its counts, and `acquire`/`release` never
block (they succeed or raise at once).

`Reserved` is a small pool apart from any tenant's share (the admin role's calls): tenants
cannot take it, so an operator's calls find a slot while tenants fill theirs.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator

from prefix_store.errors import LimitExceeded

NEWCOMER_WEIGHT = 1.0
"""The weight of the one newcomer every share leaves room for (a tenant's default)."""


def check_weight(weight: float) -> float:
    """`weight` if it is a valid share weight (finite, > 0); ValueError otherwise."""
    if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
        raise ValueError(f"weight: {weight!r} is not a finite number > 0")
    return float(weight)


class FairShare:
    """`capacity` units (slots, tickets or bytes) shared by tenants in proportion to their
    weights (see the module docstring for the exact rule). Thread-safe, O(1) per call."""

    def __init__(
        self,
        capacity: int,
        what: str,
        weight: Callable[[str], float] = lambda tenant: 1.0,
        limit: int | None = None,
        holder: str = "tenant",
    ) -> None:
        """`limit`: the most one tenant ever holds, whatever its share (None: no such cap).
        `holder`: what a tenant is called in messages (e.g. "peer" for peer addresses)."""
        if capacity < 1:
            raise ValueError(f"FairShare({what!r}): capacity must be >= 1")
        self.capacity = capacity
        self.what = what
        self.limit = limit
        self.holder = holder
        self._weight_of = weight
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._weights: dict[str, float] = {}
        """The weight of each active tenant, as read when it became active."""
        self._total = 0
        self._active_weight = 0.0

    def share(self, tenant: str, weight: float | None = None) -> float:
        """The units `tenant` may hold now (rule 1, before the at-least-one floor)."""
        with self._lock:
            w = self._weights.get(tenant) or self._read_weight(tenant, weight)
            return self._share(tenant, w)

    def acquire(self, tenant: str, amount: int = 1, weight: float | None = None) -> None:
        """Take `amount` units for `tenant` (weight `weight`, else `self.weight(tenant)`,
        when it is not active yet); LimitExceeded naming `what` and the share when the rule
        refuses them. Never blocks."""
        if amount < 0:
            raise ValueError("FairShare.acquire: amount must be >= 0")
        with self._lock:
            held = self._held.get(tenant, 0)
            w = self._weights.get(tenant) or self._read_weight(tenant, weight)
            share = self._share(tenant, w)
            if self.limit is not None and held + amount > self.limit:
                raise LimitExceeded(
                    f"{self.holder} {tenant!r}: {held} {self.what} held, {amount} more asked "
                    f"(per-{self.holder} limit {self.limit}); retry when some are released"
                )
            if held + amount > max(1.0, share):
                raise LimitExceeded(
                    f"{self.holder} {tenant!r}: {held} {self.what} held, {amount} more asked; its "
                    f"fair share is {math.floor(max(1.0, share))} of {self.capacity} "
                    f"(weight {w:g}, {len(self._held) + (held == 0)} {self.holder}s active); retry "
                    "when some are released"
                )
            free = self.capacity - self._total
            if held and self._active_weight > 0:
                free -= self.capacity * NEWCOMER_WEIGHT / (self._active_weight + NEWCOMER_WEIGHT)
            if amount > free:
                raise LimitExceeded(
                    f"server busy: {self._total} of {self.capacity} {self.what} held "
                    f"({self.holder} {tenant!r} holds {held}, its fair share "
                    f"{math.floor(max(1.0, share))}); retry shortly"
                )
            if amount == 0:
                return
            if not held:
                self._weights[tenant] = w
                self._active_weight += w
            self._held[tenant] = held + amount
            self._total += amount

    def release(self, tenant: str, amount: int = 1) -> None:
        """Give back `amount` of `tenant`'s units (never more than it holds)."""
        with self._lock:
            held = self._held.get(tenant, 0)
            amount = min(amount, held)
            if amount <= 0:
                return
            self._total -= amount
            if held == amount:
                del self._held[tenant]
                self._active_weight -= self._weights.pop(tenant)
                if not self._held:
                    self._active_weight = 0.0  # no float drift survives an idle moment
            else:
                self._held[tenant] = held - amount

    @contextlib.contextmanager
    def hold(self, tenant: str, amount: int = 1, weight: float | None = None) -> Iterator[None]:
        """`amount` of `tenant`'s units for the block (`acquire`, then `release`)."""
        self.acquire(tenant, amount, weight)
        try:
            yield
        finally:
            self.release(tenant, amount)

    def held(self, tenant: str | None = None) -> int:
        """Units `tenant` holds, or all tenants together (None)."""
        with self._lock:
            return self._total if tenant is None else self._held.get(tenant, 0)

    def active(self) -> int:
        """Tenants holding something now."""
        with self._lock:
            return len(self._held)

    def _read_weight(self, tenant: str, weight: float | None) -> float:
        w = weight if weight is not None else self._weight_of(tenant)
        try:
            return check_weight(w)
        except ValueError:
            return NEWCOMER_WEIGHT  # a broken record must not lock a tenant out

    def _share(self, tenant: str, w: float) -> float:
        """Rule 1: capacity * w / (active weights, t counted, + one newcomer)."""
        total = self._active_weight + (0.0 if tenant in self._held else w) + NEWCOMER_WEIGHT
        return self.capacity * w / total


class Reserved:
    """`capacity` units apart from every tenant's share, for callers the server trusts (the
    admin role): first come, first served among them; none left is LimitExceeded naming
    `what`. Thread-safe."""

    def __init__(self, capacity: int, what: str) -> None:
        self.capacity, self.what = capacity, what
        self._lock = threading.Lock()
        self._held = 0

    def try_acquire(self) -> bool:
        with self._lock:
            if self._held >= self.capacity:
                return False
            self._held += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._held = max(0, self._held - 1)

    def held(self) -> int:
        with self._lock:
            return self._held
