"""Round robin: each request to the next live decoder, whatever its prefix or load (the
baseline prefix affinity is measured against)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from decoder.router.policies.base import Load, Policy, Ranking


class RoundRobin(Policy):
    name = "round-robin"

    @classmethod
    def from_config(cls, config) -> RoundRobin:
        return cls()

    def __init__(self) -> None:
        self._turn = itertools.count()  # next() on a count is atomic under the GIL

    def ranking(self, identity: int) -> Ranking:
        turn = next(self._turn)

        def rotated(loads: Mapping[str, Load]) -> list[str]:
            live = sorted(loads)
            return live[turn % len(live) :] + live[: turn % len(live)] if live else []

        return rotated
