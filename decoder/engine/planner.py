"""Round planning: how many tokens each request drafts before its next verification, and in
which iteration that verification falls (DESIGN.md section 4)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from decoder.engine.request import Request
from decoder.engine.state import Running
from decoder.engine.stats import EngineStats
from decoder.horizon import Acceptance, Choice, CostModel, HorizonPolicy
from decoder.staging import RingStats


class RoundPlanner:
    """Plans rounds from the horizon policy, measured costs and the other requests' plans.

    `stagger` (None: decide from measurements) spreads the verifications of different
    prefixes across iterations while passes wait on the link, and aligns them into one pass
    while they do not."""

    def __init__(
        self,
        policy: HorizonPolicy,
        costs: CostModel,
        stagger: bool | None,
        ring_stats: RingStats,
        stats: EngineStats,
        draft_room: Callable[[Running], bool] = lambda r: True,
    ) -> None:
        """draft_room: whether a request can draft now, given its drafting buffers if it
        has none yet (`DraftBuffers.room`); a request that cannot takes exact steps."""
        self.policy = policy
        self.costs = costs
        self.stagger = stagger
        self.ring_stats = ring_stats
        self.stats = stats
        self.draft_room = draft_room

    def plan(self, members: Sequence[Running], start: int, running: Sequence[Running]) -> None:
        """Plan the next rounds of requests that verified (or were admitted) together, their
        drafting starting at iteration `start`.

        Requests that should verify together again keep one automatic horizon (the median of
        their own choices): the requests over one prefix always (one pulled copy serves
        them), and all of them when verifications are aligned rather than staggered. Each
        request's stats count its own choice's reason (`RequestStats.chose`)."""
        stagger = self.staggering()
        together: dict[int, list[Running]] = {}
        for r in members:
            together.setdefault(id(r.group) if stagger else 0, []).append(r)
        for rs in together.values():
            auto = [self.policy.choose(r.acceptance, self.costs, r.yields.per_step) for r in rs]
            common = int(statistics.median(c.horizon for c in auto))
            for r, choice in zip(rs, auto, strict=True):
                if r.req.horizon is not None:
                    choice = Choice(r.req.horizon, "fixed")
                horizon = common if r.req.horizon is None else r.req.horizon
                if min(horizon, r.remaining - 1) > 0 and not self.draft_room(r):
                    choice, horizon = Choice(0, "room"), 0
                r.stats.chose(choice)
                self._plan_round(r, start, horizon, stagger, running)
                r.acceptance.planned(choice, r.horizon)

    def drafts(self, req: Request, running: Sequence[Running]) -> bool:
        """Whether a new prefix group for `req` should draft; if not, it is served as full-KV
        decoding would serve it (`Admission`: its full prefix held here, waiting for room).
        Its own horizon decides when it has one, then the engine's fixed one; else the
        policy's choices for the requests in flight (for the prior acceptance when none):
        it drafts while most of them would draft or nothing has been measured yet."""
        if req.horizon is not None:
            return req.horizon > 0
        if self.policy.fixed is not None:
            return self.policy.fixed > 0
        records = [r.acceptance for r in running if not r.done] or [Acceptance()]
        choices = [self.policy.choose(a, self.costs) for a in records]
        return 2 * sum(c.reason in ("start", "draft") for c in choices) >= len(choices)

    def staggering(self) -> bool:
        if self.stagger is not None:
            return self.stagger
        verify_s = self.stats.verify_s
        return verify_s > 0 and self.ring_stats.stall_s > 0.1 * verify_s

    def _plan_round(self, r: Running, start: int, horizon: int, stagger: bool, running) -> None:
        horizon = max(0, min(horizon, r.remaining - 1))
        if horizon > 1:
            horizon = self._placed(r, start, horizon, stagger, running)
        r.horizon = horizon
        r.drafts = []
        r.verify_at = start + max(horizon, 1) - 1

    @staticmethod
    def _placed(r: Running, start: int, horizon: int, stagger: bool, running) -> int:
        """Shorten a round (never lengthen it, at most by half) so that it verifies in the
        same pass as other requests: of its own prefix when staggering, else of any prefix;
        when staggering, or else in an iteration no other prefix verifies in."""
        planned: dict[int, set[int]] = {}
        for other in running:
            if other is not r and not other.done and other.out:
                planned.setdefault(other.verify_at, set()).add(id(other.group))
        lowest = max(1, horizon - horizon // 2)
        for h in range(horizon, lowest - 1, -1):
            verifying = planned.get(start + h - 1, ())
            if (id(r.group) in verifying) if stagger else verifying:
                return h
        if stagger:
            for h in range(horizon, lowest - 1, -1):
                if not planned.get(start + h - 1):
                    return h
        return horizon
