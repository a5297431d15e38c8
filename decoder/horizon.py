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
for `PROBE_EVERY` rounds drafts `PROBE_HORIZON` token once (a probe) whatever the model
says. Each probe that the model did not follow into drafting doubles the wait before the
next (up to `PROBE_MAX` rounds), and a round the model itself chooses to draft brings it
back to `PROBE_EVERY`: where drafting keeps not paying, probes cost ever less of the
request's rounds, and never fewer than one in `PROBE_MAX + 1` rounds measure again.

n-gram guesses ride on a forward (the drafter's in `vericache` and `lossy`, the exact pass in
`full`): each costs that forward's fitted time per token and is taken with the request's
own measured guess acceptance until its first miss, so a request feeds the number of
guesses with the best expected tokens per second (`guess_count`), none where they cost more
than they yield (a compute-bound batched forward). A forward where it could guess but chose
not to relaxes its record toward the prior, so it guesses again now and then.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

START_HORIZON = 2
"""Auto's horizon before any round has been measured: short, since nothing says yet that
drafting pays. Where a draft step costs most of an exact one (8 requests on a CPU: 0.8) and
few drafts are taken, a first round of 8 cost each request about 6 steps' worth for one or
two tokens; one of 2 costs about 1. Where drafting pays, the next round grows to what the
measured costs and acceptance choose."""
PROBE_EVERY = 8
"""Rounds without drafting after which a request first probes (drafts `PROBE_HORIZON`)."""
PROBE_MAX = 64
"""The longest wait between probes: each probe the model did not follow doubles the wait
(`Acceptance.planned`). A request of 32 tokens the model keeps on exact steps probes once
after its start round instead of three times; one of thousands still probes every 65
rounds."""
PROBE_HORIZON = 1
"""A probe drafts one token: one draft forward for a fresh acceptance sample. Two cost every
request in the forward a second draft step (about 0.7 of an exact step for 4 requests on a
CPU) for a second sample that the first one's rejection often voids."""

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
    probe_after: int = PROBE_EVERY
    """Rounds without drafting before the next probe (`planned`)."""

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

    def planned(self, choice: Choice, horizon: int) -> None:
        """The round's choice and the horizon planned for it (requests that verify together
        share one): a probe that drafts doubles the wait before the next one (at most
        `PROBE_MAX`); the model itself choosing to draft resets it to `PROBE_EVERY`."""
        if horizon == 0:
            return
        if choice.reason == "probe":
            self.probe_after = min(PROBE_MAX, 2 * self.probe_after)
        elif choice.reason == "draft":
            self.probe_after = PROBE_EVERY


@dataclass
class DraftYield:
    """Drafts a request gains per draft forward: 1 without n-gram guesses, more when the
    drafter confirms guesses (an exponential average, starting at 1)."""

    per_step: float = 1.0
    decay: float = 0.8

    def record(self, drafts: int) -> None:
        self.per_step = self.per_step * self.decay + max(1, drafts) * (1 - self.decay)


Fitted = tuple[float, float]
"""(seconds per request, seconds per token) of a kind of forward, as fitted by `CostModel`."""


@dataclass
class CostModel:
    """Measured costs, as each request's share of the batched work it takes part in.

    A draft step's share is its time over the requests it advanced. A forward of either kind
    (verification passes; draft forwards) is fitted as `seconds = per_request * requests +
    per_token * tokens` over its recent forwards (least squares), so a request verifying
    `x + 1` tokens is charged `per_request + per_token * (x + 1)`, and a guess fed to a
    forward `per_token` (`guess_count`).
    """

    draft_share_s: float | None = None
    passes: deque = field(default_factory=lambda: deque(maxlen=32))
    drafts: deque = field(default_factory=lambda: deque(maxlen=32))

    def record_draft_step(self, seconds: float, requests: int, tokens: int | None = None) -> None:
        """A draft forward of `requests` requests feeding `tokens` tokens (default: one
        each)."""
        share = seconds / max(1, requests)
        prev = self.draft_share_s
        self.draft_share_s = share if prev is None else 0.8 * prev + 0.2 * share
        self.drafts.append((requests, requests if tokens is None else tokens, seconds))

    def record_verification(self, requests: int, tokens: int, seconds: float) -> None:
        self.passes.append((requests, tokens, seconds))

    def verify_costs(self) -> Fitted | None:
        """(seconds per request, seconds per verified token), or None before any pass; while
        the two cannot be told apart yet, each takes half of the measured time."""
        fitted = _fit(self.passes)
        if fitted is not None or not self.passes:
            return fitted
        total_s = sum(s for _, _, s in self.passes)
        requests = sum(n for n, _, _ in self.passes)
        tokens = sum(t for _, t, _ in self.passes)
        return 0.5 * total_s / requests, 0.5 * total_s / tokens

    def fitted_verify(self) -> Fitted | None:
        """Verification passes' costs once the two terms can be told apart, else None."""
        return _fit(self.passes)

    def fitted_draft(self) -> Fitted | None:
        """Draft forwards' costs once the two terms can be told apart, else None."""
        return _fit(self.drafts)


def _fit(forwards) -> Fitted | None:
    """Least squares of `seconds = per_request * requests + per_token * tokens` over
    (requests, tokens, seconds); None with fewer than 3 forwards, when they do not vary
    enough to tell the terms apart, or when a term comes out non-positive."""
    if len(forwards) < 3:
        return None
    snn = sum(n * n for n, _, _ in forwards)
    stt = sum(t * t for _, t, _ in forwards)
    snt = sum(n * t for n, t, _ in forwards)
    sns = sum(n * s for n, _, s in forwards)
    sts = sum(t * s for _, t, s in forwards)
    det = snn * stt - snt * snt
    if det <= 1e-9 * snn * stt:
        return None
    per_request = (sns * stt - sts * snt) / det
    per_token = (snn * sts - snt * sns) / det
    return (per_request, per_token) if per_request > 0 and per_token > 0 else None


def guess_count(record: Acceptance, costs: Fitted | None, limit: int) -> int:
    """How many n-gram guesses (0 to `limit`) a request feeds its next forward: the count
    with the best expected tokens per second, each guess taken with the request's measured
    probability (`record`) until its first miss, each costing `per_token` of the forward's
    fitted `costs`. Unfitted costs (None): `limit`, which also varies the forwards' sizes
    so that the fit can tell its terms apart. Ties go to fewer guesses."""
    if limit <= 0 or costs is None:
        return max(0, limit)
    per_request, per_token = costs
    best, best_speed, expected, power = 0, 0.0, 1.0, 1.0
    for k in range(limit + 1):
        if k:
            power *= record.rate
            expected += power
        speed = expected / (per_request + per_token * (1 + k))
        if speed > best_speed * (1 + 1e-9):
            best, best_speed = k, speed
    return best


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
        if best == 0 and acceptance.idle >= acceptance.probe_after:
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
