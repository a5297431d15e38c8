"""Admission under the KV budget, the prefix groups requests share, and retirement.

Everything the engine keeps for a request is reserved from the `KVBudget` before the
request is admitted (DESIGN.md section 4): its own tails, its share of what its prefix group
holds (the compressed prefix, or the full prefix in full-KV mode or after a local
recompute), and the growth of the shared staging ring and decode scratch. The queue
(`decoder.engine.queue`) offers tenants' requests round robin; one that does not fit yet is
passed by others a bounded number of times, then waits alone until its bytes fit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from decoder.budget import KVBudget
from decoder.compressors import CompressedKV, CompressorPipeline
from decoder.compressors.artifact import validate
from decoder.draft_cache import DraftCache, DraftPrefix, DraftScratch
from decoder.engine.accounting import KVBytes
from decoder.engine.config import EngineConfig
from decoder.engine.exact import recompute_prefix
from decoder.engine.ngram import NgramProposer
from decoder.engine.queue import FairQueue
from decoder.engine.request import Prefix, Request, Ticket
from decoder.engine.state import PrefixGroup, Running
from decoder.errors import Cancelled, OverBudget, Unreachable
from decoder.kv_cache import KVCache
from decoder.kv_source import LocalKVSource
from decoder.runner import ModelRunner
from decoder.sampling import Sampler
from decoder.staging import LayerRing

if TYPE_CHECKING:  # the store's client stack is imported only where a prefix is remote
    from decoder.near_data import NearData

log = logging.getLogger(__name__)

PAYBACK_PASSES = 16
"""A near-data prefix is made resident only when its pull costs at most this many near-data
passes' transfer waits (DESIGN.md section 4)."""


class Scheduler:
    """The queue, the requests in flight and their prefix groups, and their budget."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        pipeline: CompressorPipeline | None,
        budget: KVBudget,
        ring: LayerRing,
        eos: frozenset[int],
    ) -> None:
        self.runner = runner
        self.config = config
        self.pipeline = pipeline
        self.budget = budget
        self.ring = ring
        self.eos = eos
        self.bytes = KVBytes(runner.config, runner.rc.key_chunk)
        c = runner.config
        self.scratch = DraftScratch(c.num_kv_heads, c.head_dim)
        self.running: list[Running] = []
        self.groups: dict[int, PrefixGroup] = {}  # id(prefix) -> group
        self._queue: FairQueue[Ticket] = FairQueue(max_bypass=config.max_bypass)
        self._lock = threading.Lock()
        self._ring_charged = 0
        self._scratch_charged = 0
        self.timers: dict[str, float] = {}
        """The engine's timers (copied into each request at admission)."""
        if config.mode == "vericache" and config.resident:
            budget.add_reclaimer(self._demote_one)

    # -- the queue ----------------------------------------------------------------------------

    def submit(self, ticket: Ticket) -> None:
        with self._lock:
            self._queue.push(ticket, ticket.tenant)

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def drain(self) -> list[Ticket]:
        """Empty the queue; returns what was in it."""
        with self._lock:
            queued = self._queue.items()
            self._queue.remove_if(lambda _: True)
        for ticket in queued:
            self._refund(ticket)
        return queued

    def _refund(self, ticket: Ticket) -> None:
        """A ticket leaving the queue unadmitted gives back what its caller prepaid."""
        if ticket.prepaid:
            self.budget.release(ticket.prepaid)
            ticket.prepaid = 0

    def admit(self) -> list[Running]:
        """Admit queued requests that fit, in the queue's fair order; the newly admitted.

        A request that can never run (bad input, an artifact that does not fit the model,
        more bytes than the whole budget) fails alone and the next one is considered."""
        self._drop_cancelled()
        if not self.running:
            self.release_idle_buffers()  # a waiting request must not wait on our own staging
        fresh = []
        while True:
            with self._lock:
                candidates = self._queue.candidates()
            admitted = self._admit_some(candidates)
            fresh += admitted
            if not admitted:
                break
        if not self.queued:
            self._promote()
        return fresh

    def _admit_some(self, candidates: list[Ticket]) -> list[Running]:
        """Try `candidates` in order; stop early when one that does not fit has been passed
        too often (it then waits alone)."""
        admitted = []
        for ticket in candidates:
            try:
                running = self._try_admit(ticket)
            except Exception as error:
                with self._lock:
                    self._queue.remove(ticket)
                self._refund(ticket)
                ticket.finish(None, error)
                continue
            with self._lock:
                if running is None:
                    self._queue.refused(ticket)
                else:
                    self._queue.admitted(ticket)
                blocked = self._queue.blocked()
            if running is not None:
                self.running.append(running)
                admitted.append(running)
            if blocked:
                break
        return admitted

    def _drop_cancelled(self) -> None:
        with self._lock:
            cancelled = self._queue.remove_if(lambda t: t.cancelled)
        for ticket in cancelled:
            self._refund(ticket)
            ticket.finish(None, Cancelled("the request was cancelled"))
        for r in self.running:
            if r.ticket.cancelled:
                r.fail(Cancelled("the request was cancelled"))

    # -- admission ----------------------------------------------------------------------------

    def compressed(self, prefix: Prefix) -> CompressedKV:
        """The prefix's compressed KV for this engine's spec, built once per prefix."""
        assert self.pipeline is not None
        spec = self.pipeline.spec
        if spec not in prefix.artifacts:
            c = self.runner.config
            prefix.artifacts[spec] = self.pipeline.compress(
                prefix.source, prefix.observed, c.num_layers, c.num_kv_heads, c.head_dim
            )
        return prefix.artifacts[spec]

    def tail_capacity(self, req: Request) -> int:
        return len(req.suffix) + req.max_new_tokens + self.config.max_horizon + 1

    def _own_bytes(self, tail_capacity: int) -> int:
        """A request's own buffers: its exact tail and, when it drafts, its draft tail."""
        tail = self.bytes.dense(tail_capacity)
        if self.pipeline is None:
            return tail
        return tail + self.bytes.draft_tail(tail_capacity)

    def _try_admit(self, ticket: Ticket) -> Running | None:
        req = ticket.request
        self._check_suffix(req)
        capacity = self.tail_capacity(req)
        group = self.groups.get(id(req.prefix))
        new_group = group is None
        if group is not None and group.resident_charged and capacity > group.room:
            self._demote(group)  # its resident copy has no room for this request's tail
        t0 = time.perf_counter()
        if group is None:
            self._check_artifact(req.prefix)
            group = PrefixGroup(req.prefix, req.prefix.source, room=capacity)
        own = self._own_bytes(capacity)
        room = max(group.room, capacity)
        buffers = self._buffers_growth(group, room)
        # A prefix held in local memory (prefilled here, not in the store) counts too; what
        # its caller prepaid for it is taken over rather than reserved again.
        local = isinstance(group.source, LocalKVSource) and new_group
        near = self._near(group) if new_group else None
        head = near.head_bytes if near is not None else 0
        shared = buffers + (group.source.nbytes if local else 0) + head
        prepaid = min(ticket.prepaid, group.source.nbytes) if local else 0
        scratch = self._scratch_growth(group, room)
        staging = self._staging_growth(group.source.length + room)
        need = own + shared + scratch + staging - prepaid
        reserved = self.budget.try_reserve(need)
        if not reserved and head:  # pulling needs no head: admit it without near-data
            near, shared, need, head = None, shared - head, need - head, 0
            reserved = self.budget.try_reserve(need)
        if not reserved:
            # With nothing of ours in flight, this is what the request needs on its own.
            alone = need + prepaid
            if not self.running and self.budget.limit is not None and alone > self.budget.limit:
                raise OverBudget(
                    f"the request needs {alone} bytes of KV but the decoder's budget is "
                    f"{self.budget.limit} bytes"
                )
            return None
        previous_room = group.room
        try:
            if near is not None:
                group.near = self._load_near(near)
            if new_group or capacity > group.room:
                group.room = room
                self._build_shared(group)
            tail = KVCache(self.runner.config, granule=self.runner.rc.key_chunk, capacity=capacity)
            draft = DraftCache(group.draft, capacity) if group.draft is not None else None
        except BaseException:
            group.room = previous_room
            self.budget.release(need)
            raise
        self.budget.release(ticket.prepaid - prepaid)  # prepaid beyond what the prefix holds
        ticket.prepaid = 0
        group.charged += shared - (head if group.near is None else 0)
        if group.near is None and head:
            self.budget.release(head)  # its head could not be fetched: the prefix is pulled
        elif group.near is not None:
            group.near_charged = head
        group.buffers += buffers
        self._ring_charged += staging
        self._scratch_charged += scratch
        if new_group:
            self.groups[id(req.prefix)] = group
        group.members += 1
        running = Running(
            ticket,
            group,
            Sampler(req.sampling),
            tail,
            self.eos,
            charged=own,
            admitted=time.perf_counter(),
            timers=dict(self.timers),
        )
        running.draft = draft
        if self.config.ngram:
            running.proposer = NgramProposer(req.prefix.ngrams, req.suffix)
        if new_group and self.config.mode == "full" and not group.local:
            running.stats.pulled_bytes += group.source.nbytes  # the resident copy's pull
        if new_group and group.near is not None:
            running.stats.pulled_bytes += group.near.head_bytes  # the head's pull
        running.stats.compress_s = time.perf_counter() - t0
        return running

    def _check_suffix(self, req: Request) -> None:
        """A token the runner would refuse fails this request here, not a shared pass."""
        vocab = self.runner.config.vocab_size
        bad = next((t for t in req.suffix if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"suffix: token id {bad} is outside the vocabulary [0, {vocab})")

    def _check_artifact(self, prefix: Prefix) -> None:
        """The compressed prefix a new group drafts over must fit the model (one the caller
        put in `prefix.artifacts` may not); raises ArtifactFormatError."""
        if self.pipeline is not None:
            compressed = self.compressed(prefix)
            validate(compressed, self.runner.config, prefix.source.length, self.pipeline.spec)

    def _buffers_growth(self, group: PrefixGroup, room: int) -> int:
        """Budget bytes the group's shared buffers grow by to hold `room` tail tokens."""
        if self.config.mode == "full":
            return self.bytes.dense(group.source.length + room) - group.buffers
        per_token = self.bytes.draft_layer_token
        total = 0
        for layer in self.compressed(group.prefix).layers:
            total += layer.nbytes if layer.quantized else (layer.kept + room) * per_token
        return total - group.buffers

    def _scratch_growth(self, group: PrefixGroup, room: int) -> int:
        """Budget bytes the shared decode buffer of quantized prefixes grows by."""
        if self.config.mode == "full":
            return 0
        layers = self.compressed(group.prefix).layers
        if not any(layer.quantized for layer in layers):
            return 0
        widest = max(layer.kept for layer in layers) + room
        return max(0, widest * self.bytes.draft_layer_token - self._scratch_charged)

    def _staging_growth(self, capacity: int) -> int:
        if self.config.mode == "full":
            return 0
        return max(0, self.ring.bytes_for(capacity) - self._ring_charged)

    def _near(self, group: PrefixGroup) -> NearData | None:
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
    def _load_near(near: NearData) -> NearData | None:
        """Fetch the near-data head (the prefix's partial last chunk); None (the prefix is
        pulled instead) when that fails."""
        try:
            near.load_head()
        except Exception as error:  # noqa: BLE001 - any failure: verify by pulling instead
            log.info("a prefix is pulled: its near-data head could not be fetched (%r)", error)
            return None
        return near

    def fall_back_to_pull(self, group: PrefixGroup, error: BaseException) -> None:
        """Near-data attention of the group failed beyond its replicas: its passes pull."""
        log.warning("near-data attention failed (%s); the prefix's passes pull it instead", error)
        group.near = None
        self.budget.release(group.near_charged)  # its head goes with it
        group.charged -= group.near_charged
        group.near_charged = 0

    def _build_shared(self, group: PrefixGroup) -> None:
        if self.config.mode == "full":
            self._load_resident(group)
            return
        c = self.runner.config
        if group.draft is None:
            group.draft = DraftPrefix(
                self.compressed(group.prefix), c.num_kv_heads, c.head_dim, self.scratch
            )
        group.draft.ensure_room(group.room)

    def _load_resident(self, group: PrefixGroup) -> None:
        """Full mode: read the prefix's full KV into memory once, with tail room."""
        try:
            group.resident = self._resident_copy(group)
        except Exception as error:
            cache = self._empty_resident(group)
            if not self.recompute(group, cache):
                raise Unreachable(
                    f"the prefix's full KV is unreachable ({error}) and cannot be "
                    "recomputed here; no token was sent"
                ) from error
            group.resident = cache

    def _resident_copy(self, group: PrefixGroup) -> KVCache:
        """The prefix's full KV in a buffer with the group's tail room (copied from the
        current resident copy when there is one, else read from its source)."""
        p, old = group.source.length, group.resident
        cache = self._empty_resident(group)
        for index, layer in enumerate(cache.layers):
            if old is not None:
                layer.k[:, :p] = old.layers[index].k[:, :p]
                layer.v[:, :p] = old.layers[index].v[:, :p]
            else:
                group.source.read_layer(index, layer.k[:, :p], layer.v[:, :p])
        return cache

    def _empty_resident(self, group: PrefixGroup) -> KVCache:
        cache = self.runner.new_cache(capacity=group.capacity)
        for layer in cache.layers:
            layer.positions[:] = torch.arange(layer.capacity)
        return cache

    # -- resident prefixes (vericache mode) -----------------------------------------------

    def _promote(self) -> None:
        """Keep pulled prefixes resident while the budget has room, most-shared first: their
        passes then read local memory instead of pulling (DESIGN.md section 4)."""
        if self.config.mode != "vericache" or not self.config.resident:
            return
        candidates = [
            g
            for g in self.groups.values()
            if g.resident is None and g.members and not g.local and self._resident_pays(g)
        ]
        for group in sorted(candidates, key=lambda g: -g.members):
            nbytes = self.bytes.dense(group.capacity)
            if not self.budget.try_reserve(nbytes, reclaim=False):
                continue
            try:
                group.resident = self._resident_copy(group)
            except Exception as error:  # not now: its passes pull (and recover) as before
                self.budget.release(nbytes)
                log.info("a prefix stays pulled: reading it failed (%r)", error)
                continue
            group.resident_charged = nbytes
            for r in self.running:
                if r.group is group:
                    r.stats.pulled_bytes += group.source.nbytes / group.members

    def _resident_pays(self, group: PrefixGroup) -> bool:
        """Whether reading the prefix's full KV here once pays, for a prefix its passes can
        attend near the data: once two near-data passes were measured, when the pull (its bytes
        at the pull bandwidth measured here) costs at most `PAYBACK_PASSES` near-data
        passes' transfer waits. On a slow link near-data passes are cheaper than the copy."""
        near = group.near
        if near is None or self.config.placement == "pull":
            return True
        if near.stats.passes < 2:  # the first is a suffix prefill: no typical pass
            return False
        ring = self.ring.stats
        bandwidth = ring.bytes / ring.read_s if ring.read_s > 0 else near.head_bandwidth
        if not bandwidth:
            return True
        return group.source.nbytes / bandwidth <= PAYBACK_PASSES * max(near.transfer_s, 1e-3)

    def _demote(self, group: PrefixGroup) -> None:
        """Drop a resident copy: the group's passes pull again (the staging ring was charged
        for its capacity when its requests were admitted)."""
        group.resident = None
        self.budget.release(group.resident_charged)
        group.resident_charged = 0

    def _demote_one(self) -> bool:
        """Give budget back (to a request of any engine sharing it) by dropping the
        least-shared resident copy; False when there is none."""
        residents = [g for g in self.groups.values() if g.resident_charged]
        if not residents:
            return False
        self._demote(min(residents, key=lambda g: g.members))
        return True

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
        return True

    # -- retirement ---------------------------------------------------------------------------

    def retire(self, deliver: Callable[[Running], None]) -> None:
        """Release the budget of requests that ended; `deliver` those that did not fail."""
        keep = []
        for r in self.running:
            if not r.done:
                keep.append(r)
                continue
            self.budget.release(r.charged)
            g = r.group
            g.members -= 1
            if g.members == 0:
                self.budget.release(g.charged + g.resident_charged)
                self.groups.pop(id(g.prefix), None)
            if r.stop_reason != "error":
                deliver(r)
        self.running = keep
        if not self.running:
            self.release_idle_buffers()

    def release_idle_buffers(self) -> None:
        """Nothing in flight: staging and the decode scratch go back to the budget."""
        if self._ring_charged or self._scratch_charged:
            self.ring.drop()
            self.scratch.drop()
            self.budget.release(self._ring_charged + self._scratch_charged)
            self._ring_charged = self._scratch_charged = 0
