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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decoder.budget import KVBudget
from decoder.compressors import CompressorPipeline
from decoder.draft_cache import DraftCache
from decoder.engine.accounting import Footprint, KVBytes
from decoder.engine.config import EngineConfig
from decoder.engine.drafting import DraftBuffers
from decoder.engine.ngram import NgramProposer
from decoder.engine.prefix_work import compressed
from decoder.engine.queue import FairQueue
from decoder.engine.request import Request, Ticket
from decoder.engine.residency import Residency
from decoder.engine.state import InFlight, PrefixGroup, Running
from decoder.engine.stats import EngineStats
from decoder.errors import Cancelled, OverBudget
from decoder.kv_cache import KVCache
from decoder.kv_source import LocalKVSource
from decoder.runner import ModelRunner
from decoder.sampling import Sampler
from decoder.staging import LayerRing

if TYPE_CHECKING:  # the store's client stack is imported only where a prefix is remote
    from decoder.near_data import NearData

log = logging.getLogger(__name__)


@dataclass
class _Charges:
    """Budget bytes admitting one request reserves, by what they pay for."""

    room: int
    """Tail tokens the group's shared buffers leave after the prefix once it is admitted."""
    own: int
    """Its exact (and draft) tail."""
    buffers: int
    """Growth of the group's shared buffers (resident or draft prefix)."""
    local: int
    """A prefix held in local memory: its KV (the group is charged for it)."""
    scratch: int
    staging: int
    prepaid: int
    """Of a local prefix's KV, what the caller already reserved."""
    near: NearData | None
    """Near-data attention to load, or None (its head is then not charged)."""
    resident: int = 0
    """A pinned group's resident copy: its growth (`PrefixGroup.pinned`)."""

    @property
    def head(self) -> int:
        return self.near.head_bytes if self.near is not None else 0

    @property
    def shared(self) -> int:
        """What the group is charged: `buffers`, a local prefix's KV, near-data's head."""
        return self.buffers + self.local + self.head

    @property
    def need(self) -> int:
        return self.own + self.shared + self.resident + self.scratch + self.staging - self.prepaid


def _pins(config: EngineConfig, drafts, req: Request, running: list[Running], holds: bool) -> bool:
    """Whether a new group for `req` holds its full prefix here as full-KV decoding would
    (`PrefixGroup.pinned`): in vericache mode with resident prefixes allowed, when its
    passes would otherwise be remote where a copy here is better (`holds`:
    `Residency.holds`), or when it should not draft (`drafts`). Its full prefix is then
    reserved and held with it, its passes verify against that copy, and it waits for room
    like a full-KV request, instead of being admitted on its compressed copy to pull the
    whole prefix, or wait on the shards, for every pass (never slower than full KV;
    DESIGN.md section 4). A pinned group is charged what full KV holds; it drafts when the
    horizon policy says so and the budget has room for its drafting buffers
    (`DraftBuffers.room`)."""
    if config.mode != "vericache" or not config.resident:
        return False
    return holds or not drafts(req, running)


def _resident_growth(residency: Residency, group: PrefixGroup, room: int) -> int:
    """A pinned group's resident copy: the bytes it grows by to hold `room` tail tokens."""
    if not group.pinned:
        return 0
    return max(0, residency.bytes.dense(group.source.length + room) - group.resident_charged)


def _fits_at_all(budget: KVBudget, charges: _Charges) -> bool:
    """Whether the charges fit the budget at all (with nothing else in it)."""
    return budget.limit is None or charges.need + charges.prepaid <= budget.limit


class Admission:
    """The queue, and admission of its requests into the engine's requests in flight under
    the budget; retirement gives their bytes back."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        pipeline: CompressorPipeline | None,
        budget: KVBudget,
        ring: LayerRing,
        eos: frozenset[int],
        stats: EngineStats,
        flight: InFlight,
        residency: Residency,
        drafts: Callable[[Request, list[Running]], bool] = lambda req, running: True,
    ) -> None:
        """stats: the engine's (copied into each request at admission); drafts: whether a new
        group for a request drafts, given those in flight (`RoundPlanner.drafts`)."""
        self.runner = runner
        self.config = config
        self.pipeline = pipeline
        self.budget = budget
        self.ring = ring
        self.eos = eos
        self.stats = stats
        self.flight = flight
        self.residency = residency
        self.drafts = drafts
        kv_bytes = KVBytes(runner.config, runner.rc.key_chunk)
        # a prefix's compressed KV for this engine's spec, built once per prefix
        kv = (lambda prefix: compressed(pipeline, prefix, runner.config)) if pipeline else None
        self.footprint = Footprint(kv_bytes, config, kv, ring)
        spec = pipeline.spec if pipeline else ""
        self.drafting = DraftBuffers(runner.config, spec, kv, self.footprint, budget)
        self._queue: FairQueue[Ticket] = FairQueue(max_bypass=config.max_bypass)
        self._lock = threading.Lock()
        self._ring_charged = 0

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
            queued = self._queue.remove_if(lambda _: True)
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
        if not self.flight.running:
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
            self.residency.promote()
        return fresh

    def _admit_some(self, candidates: list[Ticket]) -> list[Running]:
        """Try `candidates` in order, up to one not fitting that was passed too often (it waits)."""
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
                self.flight.running.append(running)
                admitted.append(running)
            if blocked:
                break
        return admitted

    def _drop_cancelled(self) -> None:
        """Cancelled requests leave (failed); stopped ones end (`Ticket.stop`)."""
        with self._lock:
            cancelled = self._queue.remove_if(lambda t: t.cancelled)
        for ticket in cancelled:
            self._refund(ticket)
            ticket.finish(None, Cancelled("the request was cancelled"))
        for r in self.flight.running:
            r.heed_ticket()

    # -- admission ----------------------------------------------------------------------------

    def _try_admit(self, ticket: Ticket) -> Running | None:
        """Admit the ticket's request if its bytes fit; None when they do not (yet)."""
        req = ticket.request
        capacity = self.footprint.tail_capacity(req)
        group = self.flight.groups.get(id(req.prefix))
        new_group = group is None
        t0 = time.perf_counter()  # building a new group's compressed prefix counts
        self._check(req)
        grows = group is not None and capacity > group.room
        if grows and group.resident_charged and not group.pinned:
            self.residency.demote(group)  # its resident copy has no room for this request's tail
        near = None  # a new group's near-data offer: its source is asked once
        if new_group:
            group = PrefixGroup(req.prefix, req.prefix.source, room=capacity)
            near = self.residency.near(group)
            holds = self.residency.holds(group, near)
            group.pinned = _pins(self.config, self.drafts, req, self.flight.running, holds)
            if group.pinned and not _fits_at_all(
                self.budget, self._charges(ticket, group, new_group, capacity, None)
            ):
                group.pinned = False  # its full KV never fits here: remote for each pass
            if not group.pinned and self.pipeline is not None:
                self.drafting.prepare(req)
            near = None if group.pinned else near  # it reads its copy: no near-data head
        charges = self._charges(ticket, group, new_group, capacity, near)
        if not self._reserve(charges):
            return None
        previous_room = group.room
        try:
            if charges.near is not None:
                group.near = self.residency.load_near(charges.near)
            if new_group or capacity > group.room:
                group.room = charges.room
                self._build_shared(group)
            held = group.pinned and charges.resident  # a new copy, or a larger one
            if held and not self.residency.hold(group, charges.resident):
                charges.resident = 0  # unpinned: its passes pull instead, through staging
                charges.staging = self.footprint.staging_growth(group.capacity, self._ring_charged)
                self.budget.reserve(charges.staging)
            tail = KVCache(self.runner.config, granule=self.runner.rc.key_chunk, capacity=capacity)
            drafts = group.draft is not None and not group.pinned
            draft = DraftCache(group.draft, capacity) if drafts else None
        except BaseException:
            group.room = previous_room
            self.budget.release(charges.need)
            raise
        self._commit(ticket, group, charges, new_group)
        running = self._running(ticket, group, tail, charges.own)
        running.draft = draft
        held = self.config.mode == "full" or group.pinned
        if new_group and held and not group.local:
            running.stats.pulled_bytes += group.source.nbytes  # the resident copy's pull
        if new_group and group.near is not None:
            running.stats.pulled_bytes += group.near.head_bytes  # the head's pull
        running.stats.compress_s = time.perf_counter() - t0
        return running

    def _charges(self, ticket: Ticket, group: PrefixGroup, new_group: bool, capacity: int,
                 near: NearData | None) -> _Charges:  # fmt: skip
        """What admitting the ticket's request into `group` would reserve (`near`: its offer)."""
        room = max(group.room, capacity)
        # A pinned group is charged what full KV holds: drafting buffers come when it first
        # drafts (`DraftBuffers.room`); its passes read its copy, staging nothing.
        lazy = group.pinned and group.draft is None
        # A prefix held in local memory (prefilled here, not in the store) counts too; what
        # its caller prepaid for it is taken over rather than reserved again.
        local = isinstance(group.source, LocalKVSource) and new_group
        scratch = 0 if lazy else self.drafting.scratch_growth(group, room)
        staging = self.footprint.staging_growth(group.source.length + room, self._ring_charged)
        return _Charges(
            resident=_resident_growth(self.residency, group, room),
            room=room,
            own=self.footprint.own(capacity, drafts=not group.pinned),
            buffers=0 if lazy else self.footprint.buffers_growth(group, room),
            local=group.source.nbytes if local else 0,
            scratch=scratch,
            staging=0 if group.pinned else staging,
            prepaid=min(ticket.prepaid, group.source.nbytes) if local else 0,
            near=near,
        )

    def _reserve(self, charges: _Charges) -> bool:
        """Reserve the charges (without near-data's head if only that does not fit); False
        when they do not fit now, OverBudget when they never will."""
        if self.budget.try_reserve(charges.need):
            return True
        if charges.head:  # pulling needs no head: admit it without near-data
            charges.near = None
            if self.budget.try_reserve(charges.need):
                return True
        # With nothing of ours in flight, this is what the request needs on its own.
        alone = charges.need + charges.prepaid
        limit = self.budget.limit
        if not self.flight.running and limit is not None and alone > limit:
            raise OverBudget(
                f"the request needs {alone} bytes of KV but the decoder's budget is {limit} bytes"
            )
        return False

    def _commit(
        self, ticket: Ticket, group: PrefixGroup, charges: _Charges, new_group: bool
    ) -> None:
        """The reserved bytes, booked to the group and the engine's shared buffers."""
        head = charges.head
        self.budget.release(ticket.prepaid - charges.prepaid)  # beyond what the prefix holds
        ticket.prepaid = 0
        group.charged += charges.shared - (head if group.near is None else 0)
        if group.near is None and head:
            self.budget.release(head)  # its head could not be fetched: the prefix is pulled
        elif group.near is not None:
            group.near_charged = head
        group.buffers += charges.buffers
        self._ring_charged += charges.staging
        self.drafting.scratch_charged += charges.scratch
        if new_group:
            self.flight.groups[id(group.prefix)] = group
        group.members += 1

    def _running(self, ticket: Ticket, group: PrefixGroup, tail: KVCache, own: int) -> Running:
        req = ticket.request
        running = Running(
            ticket,
            group,
            Sampler(req.sampling),
            tail,
            self.eos,
            charged=own,
            admitted=time.perf_counter(),
            at_admission=self.stats.copy(),
        )
        if self.config.ngram:
            running.proposer = NgramProposer(req.prefix.ngrams, req.suffix)
        return running

    def _check(self, req: Request) -> None:
        """A token the runner would refuse fails this request here, not a shared pass."""
        vocab = self.runner.config.vocab_size
        bad = next((t for t in req.suffix if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"suffix: token id {bad} is outside the vocabulary [0, {vocab})")

    def _build_shared(self, group: PrefixGroup) -> None:
        if self.config.mode == "full":
            self.residency.load(group)
            return
        if group.pinned and group.draft is None:
            return  # built when it first drafts (`DraftBuffers.room`)
        self.drafting.build(group)

    # -- retirement ---------------------------------------------------------------------------

    def retire(self, deliver: Callable[[Running], None]) -> None:
        """Release the budget of requests that ended; `deliver` those that did not fail."""
        keep = []
        for r in self.flight.running:
            if not r.done:
                keep.append(r)
                continue
            self.budget.release(r.charged)
            g = r.group
            g.members -= 1
            if g.members == 0:
                self.budget.release(g.charged + g.resident_charged)
                self.flight.groups.pop(id(g.prefix), None)
            if r.stop_reason != "error":
                deliver(r)
        self.flight.running = keep
        if not self.flight.running:
            self.release_idle_buffers()

    def release_idle_buffers(self) -> None:
        """Nothing in flight: staging and the decode scratch go back to the budget."""
        if self._ring_charged or self.drafting.scratch_charged:
            self.ring.drop()
            self.budget.release(self._ring_charged + self.drafting.drop_scratch())
            self._ring_charged = 0
