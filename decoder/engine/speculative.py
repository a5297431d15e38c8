"""The speculative step: draft over the compressed prefix, verify over the full prefix,
accept the verified run, roll back the rest (DESIGN.md section 4).

Only the verifier's choices are ever emitted: a round emits the longest run of drafts equal
to the verifier's own choices at their positions, plus the verifier's next choice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from decoder.config import Mode
from decoder.engine.exact import ExactPasses
from decoder.engine.state import Running, grouped
from decoder.engine.stats import EngineStats
from decoder.horizon import CostModel
from decoder.runner import ModelRunner, SeqInput

log = logging.getLogger(__name__)

Each = Callable[[list[Running], Sequence, Callable], None]
"""`each(requests, values, work)`: `work(r, value)` per live request, failing it alone."""


def accept_length(drafts: Sequence[int], choices: Sequence[int]) -> int:
    """How many leading drafts the verifier agrees with.

    `choices[i]` is the verifier's token at the position of `drafts[i]` (computed with
    `drafts[:i]` in the context), so the run stops at the first mismatch: what follows a
    wrong draft was verified against a context the output will not have. `choices` holds at
    least `len(drafts)` tokens (the verifier's next choice after the last draft is extra).
    """
    if len(choices) < len(drafts):
        raise ValueError(f"{len(drafts)} drafts need as many choices, got {len(choices)}")
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
        accepted += 1
    return accepted


def rollback(r: Running, before: int, taken: int) -> None:
    """After a verification that started with `before` tail tokens and emitted `taken`:
    the verified KV of the inputs that led to emitted tokens stays in the exact tail, the
    rest is dropped. The draft tail drops its drafts and keeps the verified rows it holds;
    the rows verified since are mirrored into it when it next drafts (`catch_up`), not
    every round: a request on plain exact steps copies nothing."""
    r.tail.truncate(before + taken)
    if r.draft is not None:
        r.draft.truncate(min(r.draft.tail_length, before))


class Speculator:
    """Draft steps and verification passes for the requests of one engine."""

    def __init__(
        self,
        runner: ModelRunner,
        draft_mode: Mode,
        exact: ExactPasses,
        costs: CostModel,
        stats: EngineStats,
        each: Each,
        eos: frozenset[int],
    ) -> None:
        self.runner = runner
        self.eos = eos
        self.draft_mode = draft_mode
        self.exact = exact
        self.costs = costs
        self.stats = stats
        self.each = each

    # -- drafting ---------------------------------------------------------------------------

    def draft(self, drafting: list[Running], proposals: Callable[[Running], list[int]]) -> None:
        """One draft step: each request feeds its latest token and its `proposals(r)` (n-gram
        guesses) to one draft forward, and keeps as drafts the drafter's choices up to the
        first guess it disagrees with (one draft when there are no guesses)."""
        t0 = time.perf_counter()
        drafting = grouped(drafting, lambda r: r.group)
        for r in drafting:
            if not r.drafts:  # a round's first draft step: verified rows first
                r.draft.catch_up(r.tail)
        feeds = [[r.drafts[-1] if r.drafts else r.last, *proposals(r)] for r in drafting]
        logits = self.forward(drafting, feeds)
        self.each(drafting, list(zip(logits, feeds, strict=True)), self._extend_drafts)
        seconds = time.perf_counter() - t0
        self.costs.record_draft_step(seconds, len(drafting), sum(map(len, feeds)))
        self.stats.draft_s += seconds
        self.stats.draft_steps += 1
        self.stats.steps += 1

    def _extend_drafts(self, r: Running, checked: tuple[torch.Tensor, list[int]]) -> None:
        logits, feed = checked
        first = len(r.drafts)
        choices = r.sampler.choose_rows(logits, len(r.out) + first)
        new = _checked_run(feed, choices, self.eos)
        r.drafts.extend(new)
        r.draft.truncate(r.draft.tail_length - len(feed) + len(new))
        r.yields.record(len(new))
        _guessed(r, len(feed) - 1, len(new) - 1)
        r.stats.draft_steps += 1

    def decode(self, requests: list[Running], proposals: Callable[[Running], list[int]]) -> None:
        """Lossy decoding: the drafter's choices are emitted as they are (checked guesses
        included), without verification."""
        t0 = time.perf_counter()
        requests = grouped(requests, lambda r: r.group)
        feeds = [[r.last, *proposals(r)] for r in requests]
        logits = self.forward(requests, feeds)
        self.each(requests, list(zip(logits, feeds, strict=True)), self._emit_unverified)
        self.costs.record_draft_step(time.perf_counter() - t0, len(requests), sum(map(len, feeds)))

    def _emit_unverified(self, r: Running, checked: tuple[torch.Tensor, list[int]]) -> None:
        logits, feed = checked
        choices = r.sampler.choose_rows(logits, len(r.out))
        new = _checked_run(feed, choices, self.eos)
        taken = r.emit(new)
        r.draft.truncate(r.draft.tail_length - len(feed) + taken)
        _guessed(r, len(feed) - 1, max(0, taken - 1))

    def forward(self, requests: list[Running], feeds: list[list[int]]) -> list:
        """One draft-mode forward of each request's `feeds` tokens (grouped by prefix);
        logits of every fed token, per request. A failure is pinned on a prefix: the batch
        is undone and each prefix's requests retried alone; those whose retry fails too fail
        with it (logits None)."""
        groups = list(dict.fromkeys(r.group for r in requests))
        try:
            return self._forward(requests, feeds)
        except Exception as error:
            if len(groups) == 1:
                log.warning("drafting over one prefix failed: %r", error, exc_info=True)
                for r in requests:
                    r.fail(error)
                return [None] * len(requests)
        logits = {}
        for g in groups:
            members = [(r, f) for r, f in zip(requests, feeds, strict=True) if r.group is g]
            rs, fs = [r for r, _ in members], [f for _, f in members]
            logits.update(zip(map(id, rs), self.forward(rs, fs), strict=True))
        return [logits[id(r)] for r in requests]

    def _forward(self, requests: list[Running], feeds: list[list[int]]) -> list:
        """One draft forward over the requests' draft caches, rolled back if it raises."""
        kept = [r.draft.tail_length for r in requests]
        seqs = [SeqInput.extend(r.draft, f, "all") for r, f in zip(requests, feeds, strict=True)]
        try:
            return self.runner.forward(seqs, self.draft_mode)
        except Exception:
            for r, n in zip(requests, kept, strict=True):
                r.draft.truncate(n)
            raise

    # -- verification -----------------------------------------------------------------------

    def verify(self, ready: list[Running]) -> None:
        """One exact pass over each request's last token and drafts; accept and roll back."""
        t0 = time.perf_counter()
        kept = [len(r.tail) for r in ready]
        logits = self.exact.run([(r, [r.last, *r.drafts], "all") for r in ready])
        seconds = time.perf_counter() - t0
        tokens = sum(len(r.drafts) + 1 for r in ready)
        self.costs.record_verification(len(ready), tokens, seconds)
        self.stats.verify_s += seconds
        self.stats.verify_passes += 1
        self.each(ready, list(zip(logits, kept, strict=True)), lambda r, v: _accept(r, *v))


def _guessed(r: Running, guesses: int, taken: int) -> None:
    """`taken` of the `guesses` n-gram guesses `r` fed a forward held: counted in its stats
    and its guess record (none fed: nothing learnt; a forward that chose none is recorded
    where it chose, `Guesses.feed`)."""
    r.stats.proposed += guesses
    r.stats.proposals_taken += taken
    if guesses > 0:
        r.guessing.record(guesses, taken)


def _checked_run(feed: Sequence[int], choices: Sequence[int], eos: frozenset[int]) -> list[int]:
    """The checking forward's choices up to the first guess it disagrees with: `feed` is the
    latest token and the guesses after it, `choices[i]` the forward's choice after feed[i].
    The run ends early at an end-of-sequence token (nothing is drafted after it)."""
    run = list(choices[: accept_length(feed[1:], choices) + 1])
    stop = next((i for i, token in enumerate(run) if token in eos), None)
    return run if stop is None else run[: stop + 1]


def _accept(r: Running, logits: torch.Tensor, before: int) -> None:
    """Emit the verified run of drafts plus the verifier's next token; roll back the rest
    (`before`: the tail's length before the verification)."""
    choices = r.sampler.choose_rows(logits, len(r.out))
    accepted = accept_length(r.drafts, choices)
    if r.horizon == 0:  # an exact step (full-KV mode, or an exact round): guesses, if any
        r.acceptance.record(0, 0)
        r.stats.record_round(0, 0)
        _guessed(r, len(r.drafts), accepted)
    else:
        r.acceptance.record(len(r.drafts), accepted)
        r.stats.record_round(len(r.drafts), accepted)
    taken = r.emit(choices[: accepted + 1])
    rollback(r, before, taken)
    r.drafts = []  # the round is over: the next one drafts (or guesses) afresh
