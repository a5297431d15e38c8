"""Exact passes over requests' new tokens against their full prefix KV, and recovery.

An exact pass is one exact-mode forward of several requests' new tokens (suffix prefills,
verification rows, full-KV decode steps). Each request attends over its prefix's full KV
(resident, staged layer by layer through the `LayerRing`, or attended on the shards that
hold it: near-data) plus its own tail, seen through a `SharedPrefixView`. When near-data
attention fails beyond the replicas, the pass is undone and retried with the prefix pulled.
When a prefix's full KV cannot be read, the pass is undone, the prefix recomputed locally if
the budget allows (bitwise the KV the store held) or its requests failed with `Unreachable`,
and the pass retried for the others: no token leaves a pass that did not complete.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from decoder.config import Placement
from decoder.engine.state import PrefixGroup, Running, grouped
from decoder.kv_cache import LayerKV
from decoder.runner import Logits, ModelRunner, SeqInput
from decoder.staging import LayerRing, PrefixUnavailable
from decoder.views import SharedPrefixView

if TYPE_CHECKING:
    from decoder.near_data import RemotePass

REMEASURE = 16
"""`auto` placement: pulled passes of a near-data-capable prefix before near-data is tried
(and measured) again."""

Entry = tuple[Running, list[int], Logits]
"""A request, the tokens it feeds to the pass, and which of them need logits."""

Recover = Callable[[PrefixUnavailable, list[PrefixGroup]], None]
"""`recover(error, near)`: a prefix's full KV failed to arrive (`Residency.recover`)."""


class ExactPasses:
    """Runs exact passes for the engine (staging their prefixes' full KV)."""

    def __init__(
        self, runner: ModelRunner, ring: LayerRing, placement: Placement, recover: Recover
    ) -> None:
        """recover(error, near): called when a prefix's full KV failed to arrive (the pass is
        undone; `near` are the groups it attended near the data); it falls back, recomputes,
        or fails the requests, and the pass is retried for those still running."""
        self.runner = runner
        self.ring = ring
        self.placement = placement
        self.recover = recover
        self.peak_staging_bytes = 0
        self._near_layer: LayerKV | None = None  # for one run: dropped when it ends

    def run(self, entries: list[Entry]) -> list:
        """One exact forward over the entries; logits per entry (None for failed ones).

        Entries are ordered by prefix group so each prefix layer is staged once."""
        try:
            return self._run(entries)
        finally:
            self._near_layer = None

    def _run(self, entries: list[Entry]) -> list:
        order = grouped(range(len(entries)), lambda i: entries[i][0].group)
        result: list = [None] * len(entries)
        pending = [i for i in order if not entries[i][0].done]
        while pending:
            groups = list(dict.fromkeys(entries[i][0].group for i in pending))
            near = [g for g in groups if self.attends_near(g)]
            pulled = [g for g in groups if g.resident is None and g not in near]
            for g in pulled:
                if g.near is not None:
                    g.near.pulled_passes += 1
                    g.near.skip = False  # a busy refusal costs one pass, not the prefix
            remote = {id(g): (g, g.near.begin_pass()) for g in near}
            for g in near:
                g.near.pulled_passes = 0
            before = {i: len(entries[i][0].tail) for i in pending}
            seqs = [self._view(entries[i], pulled, remote) for i in pending]
            if pulled:
                self.ring.begin([g.pass_group() for g in pulled])
            try:
                logits = self.runner.forward(seqs, "exact")
            except PrefixUnavailable as error:
                self.ring.cancel()
                for i in pending:
                    r = entries[i][0]
                    r.tail.truncate(before[i])
                    if r.group in near and r.group.source is error.source:
                        r.stats.near_retries += 1  # its near-data pass is undone, redone
                self.recover(error, near)
                pending = [i for i in pending if not entries[i][0].done]
                continue
            finally:
                self.peak_staging_bytes = max(self.peak_staging_bytes, self.ring.nbytes)
                moved = {key: rp.close() for key, (_, rp) in remote.items()}
            self.ring.finish()
            self._charge_pulls(entries, pending, pulled)
            self._charge_near(entries, pending, remote, moved)
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

    @staticmethod
    def _charge_near(entries: list[Entry], pending: list[int], remote: dict, moved: dict) -> None:
        """Each request's share of what its prefix's near-data pass cost."""
        for key, (g, _) in remote.items():
            users = [i for i in pending if entries[i][0].group is g]
            cost = moved[key]
            for i in users:
                stats = entries[i][0].stats
                stats.near_bytes += cost.bytes / len(users)
                stats.near_wire_s += cost.wire_s / len(users)
                stats.near_shard_s += cost.shard_s / len(users)
                stats.near_passes += 1

    def _view(self, entry: Entry, pulled: list[PrefixGroup], remote: dict) -> SeqInput:
        """The request's cache for the pass: its prefix (resident, the ring's staged copy of
        it, or near-data: its partial last chunk here, the rest on the shards) and its own
        tail."""
        r, tokens, logits = entry
        g = r.group
        if id(g) in remote:
            return SeqInput.extend(self._near_view(r, remote[id(g)][1]), tokens, logits)
        if g.resident is not None:
            resident = g.resident

            def layers(i: int, resident=resident):
                return resident.layers[i]
        else:
            rank = pulled.index(g)

            def layers(i: int, rank=rank):
                return self.ring.take(rank, i)

        view = SharedPrefixView(layers, g.source.length, r.tail, prefix_id=g)
        return SeqInput.extend(view, tokens, logits)

    def attends_near(self, g: PrefixGroup) -> bool:
        """Whether the next pass attends the group's prefix on its shards rather than pulling
        it (no resident copy): always with placement `near` (unless the last near-data try
        was refused as busy: that pass pulls); with `auto` unless the measured transfer wait
        of its near-data passes (their wait for partials less the shards' compute, which
        replaces attention a pull would compute here) exceeds what pulling its bytes takes
        at the pull bandwidth measured here (the staging ring's reads, else the decoder's
        bulk reads: `NearData.pull_bandwidth`). After `REMEASURE` pulled passes `auto`
        tries near-data again (it costs few bytes), so a link that got faster or slower
        moves the choice."""
        near = g.near
        if not g.attended_near:
            return False
        assert near is not None
        if near.skip:
            return False
        if self.placement == "near" or not near.stats.passes:
            return True
        if near.pulled_passes >= REMEASURE:
            return True
        bandwidth = self.ring.stats.bandwidth or near.pull_bandwidth
        if not bandwidth:
            return True
        return near.transfer_s <= g.source.nbytes / bandwidth

    def _near_view(self, r: Running, remote: RemotePass) -> SharedPrefixView:
        """A view whose buffer holds the prefix from `near.base` on (its partial last chunk,
        refilled per layer) and the request's tail; positions below base are attended on the
        shards through `remote`."""
        g = r.group
        near = g.near
        assert near is not None
        buffer = self._near_buffer(near.head_tokens + g.room)

        def layers(i: int) -> LayerKV:
            k, v = near.head_layer(i) if near.head_tokens else (None, None)
            if k is not None:
                buffer.k[:, : near.head_tokens] = k
                buffer.v[:, : near.head_tokens] = v
            return buffer

        return SharedPrefixView(
            layers, g.source.length, r.tail, prefix_id=g, base=near.base, remote=remote
        )

    def _near_buffer(self, capacity: int) -> LayerKV:
        """The one layer buffer near-data views borrow in turn during a run (like a ring
        slot, within the ring's staging reservation: one layer of head + tail room), grown to
        `capacity` tokens; requests of one layer use it one after another."""
        c = self.runner.config
        if self._near_layer is None or self._near_layer.capacity < capacity:
            self._near_layer = LayerKV(
                c.num_kv_heads, c.head_dim, self.runner.rc.key_chunk, capacity
            )
        return self._near_layer
