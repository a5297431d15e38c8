"""Drafting buffers: a prefix group's compressed prefix, its requests' draft tails and the
decode scratch of quantized prefixes. Built with the group; for a pinned group (held as
full-KV decoding holds it) only when a request of it first drafts and the budget has room
(DESIGN.md section 4)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from decoder.budget import KVBudget
from decoder.compressors import CompressedKV
from decoder.config import ModelConfig
from decoder.draft_cache import DraftCache, DraftPrefix, DraftScratch
from decoder.engine.accounting import Footprint
from decoder.engine.request import Prefix
from decoder.engine.state import PrefixGroup, Running

log = logging.getLogger(__name__)


class DraftBuffers:
    """Builds and charges drafting buffers; owns the decode scratch they share."""

    def __init__(
        self,
        model: ModelConfig,
        compressed: Callable[[Prefix], CompressedKV] | None,
        footprint: Footprint,
        budget: KVBudget,
    ) -> None:
        """compressed: a prefix's compressed KV for the engine's spec (built once per
        prefix); None in full mode, which drafts nothing."""
        self.model = model
        self.compressed = compressed
        self.footprint = footprint
        self.budget = budget
        self.scratch = DraftScratch(model.num_kv_heads, model.head_dim)
        self.scratch_charged = 0
        """Budget bytes the scratch was charged (by admission, or `room`)."""

    def scratch_growth(self, group: PrefixGroup, room: int) -> int:
        return self.footprint.scratch_growth(group, room, self.scratch_charged)

    def build(self, group: PrefixGroup) -> None:
        """The group's compressed prefix, with room for its tails (charged by the caller)."""
        group.draft = group.draft or self._prefix(group)
        group.draft.ensure_room(group.room)

    def _prefix(self, group: PrefixGroup) -> DraftPrefix:
        m = self.model
        return DraftPrefix(self.compressed(group.prefix), m.num_kv_heads, m.head_dim, self.scratch)

    def room(self, r: Running) -> bool:
        """Give a request admitted without drafting buffers (a pinned group's) its draft
        tail, and its group the compressed prefix if it has none, when the budget has room
        for them now (nothing is reclaimed for them); False when it has not, or building
        them failed (it then takes exact steps, which need none of them). Its draft tail
        starts as a copy of its verified tail."""
        if r.draft is not None:
            return True
        group, capacity = r.group, self.footprint.tail_capacity(r.req)
        t0 = time.perf_counter()
        buffers = self.footprint.buffers_growth(group, group.room) if group.draft is None else 0
        scratch = self.scratch_growth(group, group.room)
        tail = self.footprint.bytes.draft_tail(capacity)
        need = buffers + scratch + tail
        if not self.budget.try_reserve(need, reclaim=False):
            return False
        try:
            shared = group.draft or self._prefix(group)
            shared.ensure_room(group.room)
            draft = DraftCache(shared, capacity)
            draft.copy_tail(r.tail, 0, len(r.tail))
        except Exception as error:  # noqa: BLE001 - exact steps serve it as full KV would
            log.warning("a request takes exact steps: its drafting buffers failed (%r)", error)
            self.budget.release(need)
            return False
        group.draft = shared
        group.buffers += buffers
        group.charged += buffers
        self.scratch_charged += scratch
        r.charged += tail
        r.draft = draft
        r.stats.compress_s += time.perf_counter() - t0
        return True

    def drop_scratch(self) -> int:
        """Nothing in flight: the scratch goes; the bytes it was charged (to release)."""
        self.scratch.drop()
        charged, self.scratch_charged = self.scratch_charged, 0
        return charged
