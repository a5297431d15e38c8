"""Prefix affinity with bounded loads: rendezvous hashing of a request's prefix identity
over the live decoders, a decoder at its load bound passed over.

Bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads",
2018): with m requests in flight over n live decoders, no decoder takes a new request
while it holds ceil(factor * (m + 1) / n) or more; the request goes to the next decoder in
its rendezvous order instead. A decoder whose KV budget is nearly used up is tried last.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

from decoder.router.policies.base import Load, Policy, Ranking

FULL_BUDGET = 0.95
"""KV budget use beyond which a decoder is tried after all others."""


def rendezvous(identity: int, decoders: Sequence[str]) -> list[str]:
    """`decoders` in the identity's rendezvous order (highest random weight first)."""

    def weight(decoder: str) -> bytes:
        return hashlib.sha256(f"{identity}:{decoder}".encode()).digest()

    return sorted(decoders, key=weight, reverse=True)


def choose(identity: int, loads: Mapping[str, Load], factor: float) -> list[str]:
    """The live decoders in the order to try them for a request of `identity`: its
    rendezvous order, decoders at their load bound (and nearly full ones) moved behind."""
    order = rendezvous(identity, list(loads))
    if not order:
        return []
    total = sum(load.requests for load in loads.values())
    bound = math.ceil(factor * (total + 1) / len(order))

    def rank(decoder: str) -> int:
        load = loads[decoder]
        return (load.requests >= bound) + 2 * (load.budget_use >= FULL_BUDGET)

    return sorted(order, key=rank)  # stable: rendezvous order within each rank


class Affinity(Policy):
    name = "affinity"

    @classmethod
    def from_config(cls, config) -> Affinity:
        return cls(config.load_factor)

    def __init__(self, load_factor: float) -> None:
        self.load_factor = load_factor
        """No decoder takes a request while it holds this times the average (rounded up)."""

    def ranking(self, identity: int) -> Ranking:
        return lambda loads: choose(identity, loads, self.load_factor)
