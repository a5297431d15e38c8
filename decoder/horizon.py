"""How many tokens a request drafts before the next verification (DESIGN.md section 4).

A fixed horizon drafts `x` every round. The automatic policy models a round as the draft
steps that give `x` drafts (one each, or the request's measured yield per step when n-gram
guesses are checked by the drafter) plus one verification of `x + 1` tokens (which
includes reading the full prefix), each charged at the request's share of the batched
work, and each draft as accepted with the request's own measured probability `a` until the
first rejection, so a round yields `1 + a + a^2 + ... + a^x` tokens on average. It picks the
`x` that maximises tokens per second under the costs measured so far in this engine.

A model fed only by what it chose can lock itself out: once it picks plain exact steps
(`x = 0`), no draft step or acceptance is measured again. So a request that has not drafted
for `PROBE_EVERY` rounds drafts `PROBE_HORIZON` tokens once (a probe) whatever the model
says: at most one round in `PROBE_EVERY + 1` of a request that the model keeps on exact
steps, each costing a couple of draft forwards.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

START_HORIZON = 8
"""Auto's horizon before any round has been measured."""
PROBE_EVERY = 8
"""Rounds without drafting after which a request probes (drafts `PROBE_HORIZON`) once."""
PROBE_HORIZON = 2

Reason = Literal["fixed", "start", "draft", "exact", "probe", "room"]
REASONS: tuple[str, ...] = get_args(Reason)


@dataclass(frozen=True)
class Choice:
    """A round's horizon and why (a request's stats count its rounds by `reason`)."""

    horizon: int
    reason: Reason
    """fixed: the request's own horizon; start: nothing measured yet (`START_HORIZON`);
    draft / exact: the cost model's best is drafting `horizon` > 0 tokens / plain exact
    steps; probe: the model said exact steps, but the request had not drafted for
    `PROBE_EVERY` rounds; room: it would draft, but the budget has no room for its
    drafting buffers now (a request held as full KV holds it: `DraftBuffers.room`)."""
    gain: float | None = None
    """The model's expected speed of this horizon over plain exact steps (1.0: as fast; None
    where no model decided: fixed, start)."""


@dataclass
class Acceptance:
    """A request's acceptance record, with a prior and exponential forgetting.

    A round that drafts nothing (the policy chose x = 0) relaxes the record toward the
    prior, so a request that started badly is probed again later instead of never
    drafting for the rest of its life.
    """

    successes: float = 2.8
    trials: float = 4.0
    decay: float = 0.9
    idle: int = 0
    """Rounds since the request last drafted."""

    PRIOR_SUCCESSES: ClassVar[float] = 2.8
    PRIOR_TRIALS: ClassVar[float] = 4.0

    def record(self, drafted: int, accepted: int) -> None:
        """One round: `accepted` of `drafted` drafts matched before the first mismatch."""
        self.idle = self.idle + 1 if drafted == 0 else 0
        if drafted == 0:
            self.successes = self.successes * self.decay + self.PRIOR_SUCCESSES * (1 - self.decay)
            self.trials = self.trials * self.decay + self.PRIOR_TRIALS * (1 - self.decay)
            return
        self.successes = self.successes * self.decay + accepted
        self.trials = self.trials * self.decay + min(drafted, accepted + 1)

    @property
    def rate(self) -> float:
        return min(0.999, self.successes / self.trials)


@dataclass
class DraftYield:
    """Drafts a request gains per draft forward: 1 without n-gram guesses, more when the
    drafter confirms guesses (an exponential average, starting at 1)."""

    per_step: float = 1.0
    decay: float = 0.8

    def record(self, drafts: int) -> None:
        self.per_step = self.per_step * self.decay + max(1, drafts) * (1 - self.decay)


@dataclass
class CostModel:
    """Measured costs, as each request's share of the batched work it takes part in.

    A draft step's share is its time over the requests it advanced. A verification pass is
    fitted as `seconds = per_request * requests + per_token * tokens` over recent passes
    (least squares), so a request verifying `x + 1` tokens is charged
    `per_request + per_token * (x + 1)`.
    """

    draft_share_s: float | None = None
    passes: deque = field(default_factory=lambda: deque(maxlen=32))

    def record_draft_step(self, seconds: float, requests: int) -> None:
        share = seconds / max(1, requests)
        prev = self.draft_share_s
        self.draft_share_s = share if prev is None else 0.8 * prev + 0.2 * share

    def record_verification(self, requests: int, tokens: int, seconds: float) -> None:
        self.passes.append((requests, tokens, seconds))

    def verify_costs(self) -> tuple[float, float] | None:
        """(seconds per request, seconds per verified token), or None before any pass."""
        if not self.passes:
            return None
        snn = sum(n * n for n, _, _ in self.passes)
        stt = sum(t * t for _, t, _ in self.passes)
        snt = sum(n * t for n, t, _ in self.passes)
        sns = sum(n * s for n, _, s in self.passes)
        sts = sum(t * s for _, t, s in self.passes)
        det = snn * stt - snt * snt
        if len(self.passes) >= 3 and det > 1e-9 * snn * stt:
            per_request = (sns * stt - sts * snt) / det
            per_token = (snn * sts - snt * sns) / det
            if per_request > 0 and per_token > 0:
                return per_request, per_token
        total_s = sum(s for _, _, s in self.passes)
        requests = sum(n for n, _, _ in self.passes)
        tokens = sum(t for _, t, _ in self.passes)
        return 0.5 * total_s / requests, 0.5 * total_s / tokens  # not separable yet: halves


class HorizonPolicy:
    """Fixed (`horizon=N`) or automatic (`horizon=None`, at most `max_horizon`)."""

    def __init__(self, horizon: int | None, max_horizon: int = 32) -> None:
        if horizon is not None and horizon < 0:
            raise ValueError(f"horizon must be >= 0, got {horizon}")
        if max_horizon < 1:
            raise ValueError(f"max_horizon must be >= 1, got {max_horizon}")
        self.fixed = horizon
        self.max_horizon = max_horizon

    def choose(
        self, acceptance: Acceptance, costs: CostModel, drafts_per_step: float = 1.0
    ) -> Choice:
        """The horizon for a request's next round; `drafts_per_step` (>= 1) is how many
        drafts one draft forward gives it (n-gram guesses make it more than one)."""
        if self.fixed is not None:
            return Choice(self.fixed, "fixed")
        verify = costs.verify_costs()
        if verify is None or costs.draft_share_s is None:
            return Choice(min(START_HORIZON, self.max_horizon), "start")
        speeds = self._speeds(acceptance.rate, costs.draft_share_s, *verify, drafts_per_step)
        best = max(range(len(speeds)), key=lambda x: (speeds[x], -x))
        if best == 0 and acceptance.idle >= PROBE_EVERY:
            probe = min(PROBE_HORIZON, self.max_horizon)
            return Choice(probe, "probe", speeds[probe] / speeds[0])
        return Choice(best, "draft" if best else "exact", speeds[best] / speeds[0])

    def _speeds(self, rate, draft_share_s, per_request, per_token, drafts_per_step) -> list:
        """Expected tokens per second of a round at each horizon 0 .. max_horizon."""
        speeds, expected, power = [], 1.0, 1.0
        for x in range(self.max_horizon + 1):
            if x:
                power *= rate
                expected += power
            steps = -(-x // max(1.0, drafts_per_step)) if x else 0  # ceil: forwards it takes
            seconds = steps * draft_share_s + per_request + per_token * (x + 1)
            speeds.append(expected / seconds)
        return speeds
