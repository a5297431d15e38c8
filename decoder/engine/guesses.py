"""How many n-gram guesses each forward carries (DESIGN.md section 4, composed
speculation): as many as pay under the forward's fitted costs and the request's measured
guess acceptance (`decoder.horizon.guess_count`), up to the engine's `ngram`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from decoder.engine.state import Running
from decoder.horizon import CostModel, Fitted, guess_count


class Guesses:
    """The guesses of one engine's requests, from its cost model."""

    def __init__(self, ngram: int, costs: CostModel) -> None:
        self.ngram = ngram
        self.costs = costs

    def exact(self, requests: Sequence[Running]) -> None:
        """Exact steps (full-KV mode, or a round the policy keeps exact) carry the requests'
        guesses, checked by the exact pass itself (prompt-lookup decoding)."""
        costs = self.costs.fitted_verify()
        for r in requests:
            r.drafts = self.feed(r, r.remaining - 1, costs)

    def drafted(self) -> Callable[[Running, int], list[int]]:
        """For one draft forward: the guesses it checks for a request, at most a limit (its
        costs fitted once for all of the forward's requests)."""
        costs = self.costs.fitted_draft()
        return lambda r, limit: self.feed(r, limit, costs)

    def feed(self, r: Running, limit: int, costs: Fitted | None) -> list[int]:
        """The guesses `r` feeds a forward whose fitted costs are `costs`, at most `limit`.
        Choosing none where it could guess relaxes its guess record toward the prior, so
        it guesses again now and then."""
        if r.proposer is None:
            return []
        cap = min(self.ngram, limit)
        count = guess_count(r.guessing, costs, cap)
        if cap > 0 and count == 0:
            r.guessing.record(0, 0)
        return r.proposals(count)
