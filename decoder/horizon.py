"""How many tokens a request drafts before the next verification (DESIGN.md section 4).

A fixed horizon drafts `x` every round. The automatic policy models a round as `x` draft
steps plus one verification of `x + 1` tokens plus the prefix fetch, and each draft as
accepted with the request's own measured probability `a` until the first rejection, so a
round yields `1 + a + a^2 + ... + a^x` tokens on average. It picks the `x` that maximises
tokens per second under the costs measured so far in this engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

START_HORIZON = 8
"""Auto's horizon before any round has been measured."""


@dataclass
class Acceptance:
    """A request's acceptance record, with a prior and exponential forgetting."""

    successes: float = 2.8
    trials: float = 4.0
    decay: float = 0.9

    def record(self, drafted: int, accepted: int) -> None:
        """One round: `accepted` of `drafted` drafts matched before the first mismatch."""
        if drafted == 0:
            return
        self.successes = self.successes * self.decay + accepted
        self.trials = self.trials * self.decay + min(drafted, accepted + 1)

    @property
    def rate(self) -> float:
        return min(0.999, self.successes / self.trials)


@dataclass
class CostModel:
    """Measured costs: seconds per draft step, and a line fitted to verification passes."""

    draft_step_s: float | None = None
    passes: deque = field(default_factory=lambda: deque(maxlen=32))
    fetch_s: float = 0.0

    def record_draft_step(self, seconds: float) -> None:
        prev = self.draft_step_s
        self.draft_step_s = seconds if prev is None else 0.8 * prev + 0.2 * seconds

    def record_verification(self, tokens: int, seconds: float, fetch_s: float) -> None:
        """tokens: verified tokens in the pass (all requests); fetch_s: its prefix reads."""
        self.fetch_s = 0.8 * self.fetch_s + 0.2 * fetch_s if self.passes else fetch_s
        self.passes.append((tokens, seconds))

    def verify_line(self) -> tuple[float, float] | None:
        """(fixed seconds per pass, seconds per verified token), or None before any pass."""
        if not self.passes:
            return None
        xs = [t for t, _ in self.passes]
        ys = [s for _, s in self.passes]
        n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if n >= 3 and var > 0:
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
            if slope > 0 and my - slope * mx > 0:
                return my - slope * mx, slope
        return 0.5 * my, 0.5 * my / mx  # one point: split evenly between fixed and per-token


class HorizonPolicy:
    """Fixed (`horizon=N`) or automatic (`horizon=None`, at most `max_horizon`)."""

    def __init__(self, horizon: int | None, max_horizon: int = 32) -> None:
        if horizon is not None and horizon < 0:
            raise ValueError(f"horizon must be >= 0, got {horizon}")
        if max_horizon < 1:
            raise ValueError(f"max_horizon must be >= 1, got {max_horizon}")
        self.fixed = horizon
        self.max_horizon = max_horizon

    def choose(self, acceptance: Acceptance, costs: CostModel) -> int:
        if self.fixed is not None:
            return self.fixed
        line = costs.verify_line()
        if line is None or costs.draft_step_s is None:
            return min(START_HORIZON, self.max_horizon)
        fixed, per_token = line
        rate = acceptance.rate
        best, best_speed, expected, power = 0, 0.0, 1.0, 1.0
        for x in range(self.max_horizon + 1):
            if x:
                power *= rate
                expected += power
            seconds = x * costs.draft_step_s + fixed + per_token * (x + 1)
            if expected / seconds > best_speed:
                best, best_speed = x, expected / seconds
        return best
