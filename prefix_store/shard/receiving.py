"""Puts being received: the shard's receive budget and the quota their new bytes hold.

A put holds, from its header on, the new bytes it declared against its owner's quota (so
concurrent puts cannot together pass checks each passes alone), and of the receive budget
(`ShardConfig.receive_bytes`, in tenants' fair shares) only the bytes that arrived
(`Reservation.grow`). Both are released once, by its commit or its end."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefix_store.config import ShardConfig
from prefix_store.errors import Aborted, InvalidArgument, LimitExceeded, StoreFull
from prefix_store.shard.usage import Allowance, check_quota
from prefix_store.shares import FairShare

if TYPE_CHECKING:
    from prefix_store.shard.holdings import Holdings


@dataclass(slots=True)
class Reservation:
    """What one put holds while its bytes arrive (see `Receiving.reserve`): `new` bytes of
    its owner's quota, and of the receive budget the bytes that arrived. `release` once."""

    receiving: Receiving
    owner: str
    declared: int
    new: int
    weight: float | None = None
    """The owner's weight in the shares (None: the budget's `weight` reads it)."""
    staged: int = 0
    """Bytes received so far, held in the owner's share of the receive budget."""
    released: bool = False

    def grow(self, nbytes: int) -> None:
        """Hold `nbytes` more that are about to be buffered (LimitExceeded over the owner's
        share of the receive budget)."""
        if self.released:
            raise Aborted("put: it already ended; nothing was stored")
        if self.staged + nbytes > self.declared:
            raise InvalidArgument(f"put: more than the {self.declared} bytes its header declared")
        self.receiving.budget.acquire(self.owner, nbytes, self.weight)
        self.staged += nbytes

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.receiving.release(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Receiving:
    """The puts a shard is receiving. Thread-safe (the holdings' lock, and the budget's)."""

    def __init__(
        self, config: ShardConfig, holdings: Holdings, weight: Callable[[str], float]
    ) -> None:
        """`weight(tenant)`: the tenant's weight in the shares of the receive budget."""
        self.config, self.holdings = config, holdings
        self.budget = FairShare(config.receive_bytes, "bytes of puts being received", weight)
        self.held_new: Counter = Counter()
        """New bytes that puts being received declared, per owner (held against its quota)."""

    def reserve(
        self,
        owner: str,
        allowance: Allowance | None,
        declared: int,
        new: int,
        room: bool = False,
        weight: float | None = None,
    ) -> Reservation:
        """Admit a put declaring `declared` bytes, `new` of them new to the shard: refused
        now what cannot fit (new bytes over the owner's quota, counting the puts it has
        arriving: QuotaExceeded; `room`: no room in the tiers: StoreFull; declared bytes over
        the owner's share of the receive budget now: LimitExceeded). Holds `new` bytes of the
        owner's quota from now, but none of the receive budget: `Reservation.grow` takes
        that as the bytes arrive (`weight`: the owner's in the shares)."""
        holdings = self.holdings
        with holdings.lock:
            check_quota(holdings.stats.usage, owner, allowance, self.held_new[owner] + new)
            if room and not holdings.placement.room_for(new):
                raise StoreFull(f"shard {self.config.shard_id}: no room for {new} bytes")
            share = self.budget.share(owner, weight)
            if declared > share:
                raise LimitExceeded(
                    f"tenant {owner!r}: a put of {declared} bytes exceeds its fair share of "
                    f"{int(share)} of the {self.config.receive_bytes} bytes of puts this shard "
                    "receives at once (receive_bytes); retry later or put fewer chunks at once"
                )
            self.held_new[owner] += new
        return Reservation(self, owner, declared, new, weight)

    def held(self, owner: str | None = None) -> int:
        """Bytes of puts arriving that are buffered now (`owner`'s, or everyone's)."""
        return self.budget.held(owner)

    def release(self, reservation: Reservation) -> None:
        self.budget.release(reservation.owner, reservation.staged)
        with self.holdings.lock:
            self.held_new[reservation.owner] -= reservation.new
            if self.held_new[reservation.owner] <= 0:
                del self.held_new[reservation.owner]
