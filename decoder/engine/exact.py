"""Exact passes over requests' new tokens against their full prefix KV, and recovery.

An exact pass is one exact-mode forward of several requests' new tokens (suffix prefills,
verification rows, full-KV decode steps). Each request attends over its prefix's full KV
(staged layer by layer through the `LayerRing`, or resident) plus its own tail, seen through
a `SharedPrefixView`. When a prefix's full KV cannot be read, the pass is undone, the prefix
recomputed locally if the budget allows (bitwise the KV the store held) or its requests
failed with `Unreachable`, and the pass retried for the others: no token leaves a pass that
did not complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from decoder.engine.state import PrefixGroup, Running, grouped
from decoder.errors import Unreachable
from decoder.kv_cache import KVCache
from decoder.kv_source import LocalKVSource
from decoder.runner import Logits, ModelRunner, SeqInput
from decoder.staging import PrefixUnavailable
from decoder.views import SharedPrefixView

if TYPE_CHECKING:
    from decoder.engine.scheduler import Scheduler

Entry = tuple[Running, list[int], Logits]
"""A request, the tokens it feeds to the pass, and which of them need logits."""


def recompute_prefix(
    runner: ModelRunner, tokens: Sequence[int], cache: KVCache | None
) -> LocalKVSource:
    """Exact prefill of a prefix (bitwise the KV any exact decoder computes for it)."""
    if cache is None:
        cache = runner.new_cache(capacity=len(tokens))
    runner.forward([SeqInput.extend(cache, list(tokens), logits="none")], "exact")
    return LocalKVSource(cache, len(tokens))


class ExactPasses:
    """Runs exact passes for the engine (staging their prefixes' full KV)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.runner = scheduler.runner
        self.ring = scheduler.ring
        self.peak_staging_bytes = 0

    def run(self, entries: list[Entry]) -> list:
        """One exact forward over the entries; logits per entry (None for failed ones).

        Entries are ordered by prefix group so each prefix layer is staged once."""
        order = grouped(range(len(entries)), lambda i: entries[i][0].group)
        result: list = [None] * len(entries)
        pending = [i for i in order if not entries[i][0].done]
        while pending:
            groups = list(dict.fromkeys(entries[i][0].group for i in pending))
            pulled = [g for g in groups if g.pulled]
            before = {i: len(entries[i][0].tail) for i in pending}
            seqs = [self._view(entries[i], pulled) for i in pending]
            if pulled:
                self.ring.begin([g.pass_group() for g in pulled])
            try:
                logits = self.runner.forward(seqs, "exact")
            except PrefixUnavailable as error:
                self.ring.cancel()
                for i in pending:
                    entries[i][0].tail.truncate(before[i])
                self._recover(error)
                pending = [i for i in pending if not entries[i][0].done]
                continue
            finally:
                self.peak_staging_bytes = max(self.peak_staging_bytes, self.ring.nbytes)
            self.ring.finish()
            self._charge_pulls(entries, pending, pulled)
            for i, lg in zip(pending, logits, strict=True):
                result[i] = lg
            break
        return result

    @staticmethod
    def _charge_pulls(entries: list[Entry], pending: list[int], groups) -> None:
        """Each request's share of the prefixes pulled for the pass."""
        for g in groups:
            users = [i for i in pending if entries[i][0].group is g]
            for i in users:
                entries[i][0].stats.pulled_bytes += g.source.nbytes / len(users)

    def _view(self, entry: Entry, pulled: list[PrefixGroup]) -> SeqInput:
        """The request's cache for the pass: its prefix (resident, or the ring's staged copy
        of it) and its own tail."""
        r, tokens, logits = entry
        g = r.group
        if not g.pulled:
            resident = g.resident

            def layers(i: int, resident=resident):
                return resident.layers[i]
        else:
            rank = pulled.index(g)

            def layers(i: int, rank=rank):
                return self.ring.take(rank, i)

        view = SharedPrefixView(layers, g.source.length, r.tail, prefix_id=g)
        return SeqInput.extend(view, tokens, logits)

    def _recover(self, error: PrefixUnavailable) -> None:
        """A prefix's full KV failed to arrive: recompute it locally, or fail its requests."""
        s = self.scheduler
        group = next((g for g in s.groups.values() if g.source is error.source), None)
        if group is None:
            raise error
        if s.recompute(group, None):
            return
        reason = Unreachable(
            f"the prefix's full KV is unreachable ({error.cause}) and recomputing it locally "
            f"needs {group.source.nbytes} bytes the decoder's KV budget does not have; no "
            "unverified token was sent"
            if s.config.recompute
            else f"the prefix's full KV is unreachable ({error.cause})"
        )
        for r in s.running:
            if r.group is group:
                r.fail(reason)
