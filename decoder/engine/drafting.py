"""Drafting buffers: a prefix group's compressed prefix, its requests' draft tails and the
decode scratch of quantized prefixes. Built with the group; for a pinned group (held as
full-KV decoding holds it) only when a request of it first drafts and the budget has room
(DESIGN.md section 4)."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

from decoder.budget import KVBudget
from decoder.compressors import CompressedKV
from decoder.compressors.artifact import validate
from decoder.config import ModelConfig
from decoder.draft_cache import DraftCache, DraftPrefix, DraftScratch
from decoder.engine.accounting import Footprint
from decoder.engine.request import Prefix, Request
from decoder.engine.state import PrefixGroup, Running

log = logging.getLogger(__name__)


class DraftBuffers:
    """Builds and charges drafting buffers; owns the decode scratch they share."""

    def __init__(
        self,
        model: ModelConfig,
        spec: str,
        compressed: Callable[[Prefix], CompressedKV] | None,
        footprint: Footprint,
        budget: KVBudget,
    ) -> None:
        """spec: the engine's compressor; compressed: a prefix's compressed KV for it, built
        once per prefix and kept with it; None in full mode, which drafts nothing."""
        self.model = model
        self.spec = spec
        self.compressed = compressed
        self.footprint = footprint
        self.budget = budget
        self.scratch = DraftScratch(model.num_kv_heads, model.head_dim)
        self.scratch_charged = 0
        """Budget bytes the scratch was charged (by admission, or `room`)."""
        self._refused: weakref.WeakKeyDictionary[PrefixGroup, int] = weakref.WeakKeyDictionary()
        """Per group `room` refused, the budget's use then: it is not tried again (nor its
        compressed KV loaded again) until the budget has given bytes back."""

    def scratch_growth(self, group: PrefixGroup, room: int) -> int:
        return self.footprint.scratch_growth(group, room, self.scratch_charged)

    def load(self, req: Request) -> tuple[CompressedKV, bool]:
        """The prefix's compressed KV, and whether it is new: loaded from the request's
        `artifacts`, neither kept nor charged yet. One kept with the prefix, or built here
        when the request has no `artifacts` (kept, uncharged), is not new."""
        kv = req.prefix.artifacts.get(self.spec)
        if kv is not None or req.artifacts is None:
            return kv if kv is not None else self.compressed(req.prefix), False
        return req.artifacts.load(self.spec), True

    def build(self, group: PrefixGroup) -> None:
        """The group's compressed prefix, with room for its tails (charged by the caller)."""
        if group.draft is None:
            group.draft = self._prefix(group, self.compressed(group.prefix))
        group.draft.ensure_room(group.room)

    def _prefix(self, group: PrefixGroup, kv: CompressedKV) -> DraftPrefix:
        m = self.model
        return DraftPrefix(kv, m.num_kv_heads, m.head_dim, self.scratch)

    def prepare(self, req: Request) -> None:
        """The compressed prefix a new group drafts over: kept with the prefix, else loaded
        from the request's `artifacts` and charged (as a prefix's artifacts are), else built
        here. One that does not fit the model (a caller may have put it in
        `prefix.artifacts`: ArtifactFormatError) fails this request here, not a shared pass."""
        kv, new = self.load(req)
        validate(kv, self.model, req.prefix.source.length, self.spec)
        if new and req.artifacts is not None:
            self.budget.reserve(kv.nbytes)
            req.artifacts.keep(self.spec, kv)

    def room(self, r: Running) -> bool:
        """Give a request admitted without drafting buffers (a pinned group's) its draft
        tail, and its group the compressed prefix if it has none (loaded, then charged,
        when it is not kept with the prefix yet), when the budget has room for them now
        (nothing is reclaimed for them); False when it has not, or building them failed (it
        then takes exact steps, which need none of them). Its draft tail starts as a copy of
        its verified tail."""
        if r.draft is not None:
            return True
        group, capacity = r.group, self.footprint.tail_capacity(r.req)
        if self.budget.used >= self._refused.get(group, self.budget.used + 1):
            return False  # nothing was given back since it was refused
        tail = self.footprint.bytes.draft_tail(capacity)
        if not self.budget.fits(tail):
            self._refused[group] = self.budget.used  # not even its tail: load nothing
            return False
        t0 = time.perf_counter()
        shared = group.draft
        try:
            kv, new = (shared.compressed, False) if shared is not None else self.load(r.req)
        except Exception as error:  # noqa: BLE001 - exact steps serve it as full KV would
            log.warning("a request takes exact steps: its compressed KV failed (%r)", error)
            self._refused[group] = self.budget.used
            return False
        buffers = 0 if shared is not None else self.footprint.buffers_growth(group, group.room, kv)
        scratch = self.footprint.scratch_growth(group, group.room, self.scratch_charged, kv)
        need = (kv.nbytes if new else 0) + buffers + scratch + tail
        if not self.budget.try_reserve(need, reclaim=False):
            self._refused[group] = self.budget.used
            return False
        if new:  # its bytes are the keeper's from now on
            r.req.artifacts.keep(self.spec, kv)
            need -= kv.nbytes
        try:
            shared = shared if shared is not None else self._prefix(group, kv)
            shared.ensure_room(group.room)
            draft = DraftCache(shared, capacity)
            draft.copy_tail(r.tail, 0, len(r.tail))
        except Exception as error:  # noqa: BLE001 - exact steps serve it as full KV would
            log.warning("a request takes exact steps: its drafting buffers failed (%r)", error)
            self.budget.release(need)
            self._refused[group] = self.budget.used
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
