"""Where a prefix's full KV comes from for its exact passes: a copy held here (always in full
mode; in vericache mode while the budget has room), the store, near-data attention on the
shards, or a local recompute after the store failed (DESIGN.md section 4)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from decoder.budget import KVBudget
from decoder.engine.accounting import KVBytes
from decoder.engine.config import EngineConfig
from decoder.engine.prefix_work import recompute_prefix
from decoder.engine.state import InFlight, PrefixGroup
from decoder.errors import Unreachable
from decoder.kv_cache import KVCache
from decoder.kv_source import LocalKVSource
from decoder.runner import ModelRunner
from decoder.staging import LayerRing, PrefixUnavailable
from prefix_store.errors import LimitExceeded

if TYPE_CHECKING:  # the store's client stack is imported only where a prefix is remote
    from decoder.near_data import NearData

log = logging.getLogger(__name__)

PAYBACK_PASSES = 16
"""A near-data prefix is made resident only when its pull costs at most this many near-data
passes' waits (DESIGN.md section 4)."""


class Residency:
    """Resident copies of prefixes (load, promote, demote), local recompute, and recovery
    when a prefix's full KV fails to arrive."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        budget: KVBudget,
        ring: LayerRing,
        flight: InFlight,
    ) -> None:
        self.runner = runner
        self.config = config
        self.budget = budget
        self.ring = ring
        self.flight = flight
        self.bytes = KVBytes(runner.config, runner.rc.key_chunk)
        if config.mode == "vericache" and config.resident:
            budget.add_reclaimer(self._demote_one)

    # -- resident copies ----------------------------------------------------------------------

    def load(self, group: PrefixGroup) -> None:
        """Full mode: read the prefix's full KV into memory once, with tail room."""
        try:
            group.resident = self._copy(group)
        except Exception as error:
            cache = self._empty(group)
            if not self.recompute(group, cache):
                raise Unreachable(
                    f"the prefix's full KV is unreachable ({error}) and cannot be "
                    "recomputed here; no token was sent"
                ) from error
            group.resident = cache

    def hold(self, group: PrefixGroup, nbytes: int) -> bool:
        """Make (or grow, for a larger room) a pinned group's resident copy, `nbytes` more of
        the budget already reserved for it. If reading the prefix fails, the bytes go back,
        the group is unpinned and its passes pull (and recover) instead: False."""
        try:
            group.resident = self._copy(group)
        except Exception as error:  # noqa: BLE001 - its passes pull it as before
            log.info("a prefix is pulled, not held: reading it failed (%r)", error)
            self.budget.release(nbytes)
            group.pinned = False
            return False
        group.resident_charged += nbytes
        return True

    def _copy(self, group: PrefixGroup) -> KVCache:
        """The prefix's full KV in a buffer with the group's tail room (copied from the
        current resident copy when there is one, else read from its source)."""
        p, old = group.source.length, group.resident
        cache = self._empty(group)
        for index, layer in enumerate(cache.layers):
            if old is not None:
                layer.k[:, :p] = old.layers[index].k[:, :p]
                layer.v[:, :p] = old.layers[index].v[:, :p]
            else:
                group.source.read_layer(index, layer.k[:, :p], layer.v[:, :p])
        return cache

    def _empty(self, group: PrefixGroup) -> KVCache:
        cache = self.runner.new_cache(capacity=group.capacity)
        for layer in cache.layers:
            layer.positions[:] = torch.arange(layer.capacity)
        return cache

    def promote(self) -> None:
        """Keep pulled prefixes resident while the budget has room, most-shared first: their
        passes then read local memory instead of pulling (DESIGN.md section 4)."""
        if self.config.mode != "vericache" or not self.config.resident:
            return
        candidates = [
            g
            for g in self.flight.groups.values()
            if g.resident is None and g.members and not g.local and self._pays(g)
        ]
        for group in sorted(candidates, key=lambda g: -g.members):
            nbytes = self.bytes.dense(group.capacity)
            if not self.budget.try_reserve(nbytes, reclaim=False):
                continue
            try:
                group.resident = self._copy(group)
            except Exception as error:  # not now: its passes pull (and recover) as before
                self.budget.release(nbytes)
                log.info("a prefix stays pulled: reading it failed (%r)", error)
                continue
            group.resident_charged = nbytes
            for r in self.flight.running:
                if r.group is group:
                    r.stats.pulled_bytes += group.source.nbytes / group.members

    def _pays(self, group: PrefixGroup) -> bool:
        """Whether reading a group's prefix here once pays (`copy_pays` of its near-data
        attention; a prefix without it pulls for every pass, so a copy always pays)."""
        near = group.near
        return near is None or self.copy_pays(group, near)

    def copy_pays(self, group: PrefixGroup, near: NearData) -> bool:
        """Whether reading the prefix's full KV here once pays, for a prefix its passes can
        attend near the data (`near`): once two near-data passes were measured, when the
        pull (its bytes at the pull bandwidth measured here) costs at most `PAYBACK_PASSES`
        near-data passes' waits (`NearData.wait_s`: a resident pass waits for none of it, the
        shards' compute included). On a slow link near-data passes are cheaper than the copy.
        Before that (the first pass is a suffix prefill, no typical pass), when the pull
        costs at most `PAYBACK_PASSES` passes' least possible wait: a round trip per layer
        (layer l+1's queries need layer l's partials). Measuring first would only cost
        near-data passes."""
        if self.config.placement == "pull":
            return True
        bandwidth = self.ring.stats.bandwidth or near.pull_bandwidth
        pull_s = group.source.nbytes / bandwidth if bandwidth else 0.0
        if near.stats.passes < 2:
            least = near.prefix.layout.num_layers * near.client.link.round_trip_s
            return bandwidth > 0 and pull_s <= PAYBACK_PASSES * least
        return pull_s <= PAYBACK_PASSES * max(near.wait_s, 1e-3)

    def demote(self, group: PrefixGroup) -> None:
        """Drop a resident copy: the group's passes pull again (the staging ring was charged
        for its capacity when its requests were admitted)."""
        group.resident = None
        self.budget.release(group.resident_charged)
        group.resident_charged = 0

    def _demote_one(self) -> bool:
        """Give budget back (to a request of any engine sharing it) by dropping the
        least-shared resident copy; False when there is none."""
        residents = [g for g in self.flight.groups.values() if g.resident_charged and not g.pinned]
        if not residents:
            return False
        self.demote(min(residents, key=lambda g: g.members))
        return True

    # -- near-data attention ------------------------------------------------------------------

    def holds(self, group: PrefixGroup, near: NearData | None) -> bool:
        """Whether a new group's prefix is better held here than verified remotely: a store
        prefix (not one in this decoder's memory, which the budget already holds) whose
        passes would pull it every time (no near-data attention: `near`, what `near(group)`
        gave, is None), or would attend near the data where reading it once pays
        (`copy_pays`, with the link measured first). A near-data pass keeps every request of
        its forward waiting for the link and the shards, so where a copy pays, waiting for
        room to hold it serves as full KV would and no worse."""
        if isinstance(group.source, LocalKVSource):
            return False
        if near is None:
            return True
        near.measure_link()
        return self.copy_pays(group, near)

    def near(self, group: PrefixGroup) -> NearData | None:
        """The new group's near-data attention when the config and its source allow it: a
        store prefix with a full chunk whose shards run this decoder's kernel, chunked like
        the runner's attention."""
        if self.config.mode != "vericache" or self.config.placement == "pull":
            return None
        offer = getattr(group.source, "near_data", None)
        if offer is None:
            return None
        near = offer(self.runner.config.num_heads)
        if (
            near is None
            or near.base == 0
            or near.prefix.layout.chunk_tokens != self.runner.rc.key_chunk
        ):
            return None
        return near

    @staticmethod
    def load_near(near: NearData) -> NearData | None:
        """Fetch the near-data head (the prefix's partial last chunk); None (the prefix is
        pulled instead) when that fails."""
        try:
            near.load_head()
        except Exception as error:  # noqa: BLE001 - any failure: verify by pulling instead
            log.info("a prefix is pulled: its near-data head could not be fetched (%r)", error)
            return None
        return near

    # -- failures -----------------------------------------------------------------------------

    def recompute(self, group: PrefixGroup, cache: KVCache | None) -> bool:
        """Recompute the group's prefix here (into `cache`, or a new buffer charged to the
        budget); False when recomputing is off, already done, or the bytes do not fit."""
        if not self.config.recompute or group.local:
            return False
        extra = 0 if cache is not None else self.bytes.dense(group.source.length)
        if not self.budget.try_reserve(extra):
            return False
        try:
            group.source = recompute_prefix(self.runner, group.prefix.tokens, cache)
        except BaseException:
            self.budget.release(extra)
            raise
        group.charged += extra
        group.local = True
        self.drop_near(group)  # a local copy: no pass attends on the shards it replaced
        return True

    def fall_back_to_pull(self, group: PrefixGroup, error: BaseException) -> None:
        """Near-data attention of the group failed beyond its replicas: its passes pull."""
        log.warning("near-data attention failed (%s); the prefix's passes pull it instead", error)
        self.drop_near(group)

    def drop_near(self, group: PrefixGroup) -> None:
        """The group's passes no longer attend near the data; its head's bytes go back to
        the budget. (A group recomputed locally must drop it: its near-data session reads
        the store's copy, whose source the group no longer has, so a later failure there
        could not be traced back to the group.)"""
        group.near = None
        self.budget.release(group.near_charged)  # its head goes with it
        group.charged -= group.near_charged
        group.near_charged = 0

    def recover(self, error: PrefixUnavailable, near: list[PrefixGroup]) -> None:
        """A prefix's full KV failed to arrive in an exact pass. Near-data attention (in the
        failed attempt, `near`) that was refused as busy pulls for the next pass only;
        otherwise it falls back to pulling for good. A pull recomputes it locally, or fails
        its requests."""
        group = self.flight.group_reading(error.source)
        if group is None:
            raise error
        if group in near:
            if isinstance(error.cause, LimitExceeded) and group.near is not None:
                group.near.skip = True
            else:
                self.fall_back_to_pull(group, error.cause)
            return
        if self.recompute(group, None):
            return
        reason = Unreachable(
            f"the prefix's full KV is unreachable ({error.cause}) and recomputing it locally "
            f"needs {group.source.nbytes} bytes the decoder's KV budget does not have; no "
            "unverified token was sent"
            if self.config.recompute
            else f"the prefix's full KV is unreachable ({error.cause})"
        )
        self.flight.fail_group(group, reason)
