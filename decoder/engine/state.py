"""The engine's state of requests in flight: per prefix (`PrefixGroup`) and per request
(`Running`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from decoder.draft_cache import DraftCache, DraftPrefix
from decoder.engine.ngram import NgramProposer
from decoder.engine.request import Prefix, Request, Ticket
from decoder.engine.stats import EngineStats, RequestStats
from decoder.errors import Cancelled
from decoder.horizon import Acceptance, DraftYield
from decoder.kv_cache import KVCache
from decoder.kv_source import FullKVSource
from decoder.sampling import Sampler
from decoder.staging import PassGroup

if TYPE_CHECKING:  # the store's client stack is imported only where a prefix is remote
    from decoder.near_data import NearData

T = TypeVar("T")


@dataclass(eq=False)
class PrefixGroup:
    """The requests in flight over one prefix, and what they share."""

    prefix: Prefix
    source: FullKVSource
    room: int  # tail tokens the shared buffers leave after the prefix
    members: int = 0
    charged: int = 0  # budget bytes of the shared part
    buffers: int = 0  # of which: the shared buffers (resident prefix, draft prefix)
    resident: KVCache | None = None
    """The prefix's full KV (+ room) held here: always in full mode; in vericache mode while
    the budget has room for it (then its passes read it instead of pulling)."""
    resident_charged: int = 0  # vericache mode: budget bytes of `resident`
    pinned: bool = False
    """Vericache mode: admitted to be served as full-KV decoding would (`Admission`): its
    resident copy was reserved with it and is never demoted to make room."""
    draft: DraftPrefix | None = None
    local: bool = False  # recomputed here after the store failed
    near: NearData | None = None
    """Near-data attention of the prefix (its passes attend it on its shards), or None."""
    near_charged: int = 0  # budget bytes of near's local head (the prefix's partial chunk)

    @property
    def capacity(self) -> int:
        return self.source.length + self.room

    @property
    def attended_near(self) -> bool:
        """Exact passes can attend this prefix on its shards (near-data offered, no resident
        copy); `ExactPasses.attends_near` decides per pass."""
        return self.resident is None and self.near is not None

    def pass_group(self) -> PassGroup:
        return PassGroup(self.source, self.capacity)


@dataclass(eq=False)
class Running:
    """A request in flight: its exact tail, its draft tail, its round and its output."""

    ticket: Ticket
    group: PrefixGroup
    sampler: Sampler
    tail: KVCache
    eos: frozenset[int]
    charged: int
    admitted: float
    out: list[int] = field(default_factory=list)
    draft: DraftCache | None = None
    drafts: list[int] = field(default_factory=list)
    horizon: int = 0
    verify_at: int = 0  # iteration of this round's verification (staggering)
    acceptance: Acceptance = field(default_factory=Acceptance)
    yields: DraftYield = field(default_factory=DraftYield)
    guessing: Acceptance = field(default_factory=Acceptance)
    """How often its n-gram guesses are taken (`decoder.horizon.guess_count`)."""
    stats: RequestStats = field(default_factory=RequestStats)
    at_admission: EngineStats = field(default_factory=EngineStats)
    """The engine's stats when the request was admitted (its own share is the difference)."""
    decode_start: float = 0.0
    stop_reason: str = ""
    proposer: NgramProposer | None = None
    """Prompt-lookup proposals over the prefix, suffix and output (None: no n-gram)."""

    @property
    def req(self) -> Request:
        return self.ticket.request

    @property
    def last(self) -> int:
        return self.out[-1]

    @property
    def remaining(self) -> int:
        return self.req.max_new_tokens - len(self.out)

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    def emit(self, tokens: Sequence[int]) -> int:
        """Append verified tokens up to a stop, tell the listener; returns how many."""
        taken = 0
        for token in tokens:
            if self.done:
                break
            self.out.append(token)
            taken += 1
            if token in self.eos:
                self.stop_reason = "eos"
            elif token in self.req.stop_ids:
                self.stop_reason = "stop"
            elif self.remaining <= 0:
                self.stop_reason = "length"
        if taken and self.proposer is not None:
            self.proposer.extend(self.out[-taken:])
        if taken and self.ticket.on_tokens is not None:
            self.ticket.on_tokens(self.out[-taken:])
        return taken

    def proposals(self, limit: int) -> list[int]:
        """Up to `limit` prompt-lookup guesses of the tokens after the current drafts."""
        if self.proposer is None or limit <= 0:
            return []
        return self.proposer.propose(self.drafts, limit)

    def start(self, prefill_s: float) -> None:
        self.stats.prefill_s = prefill_s
        self.decode_start = time.perf_counter()

    def heed_ticket(self) -> None:
        """End the request as its caller asked: failed when cancelled (`Ticket.cancel`), or
        with its tokens so far when stopped (`Ticket.stop`: stop reason "stop")."""
        if self.ticket.cancelled:
            self.fail(Cancelled("the request was cancelled"))
        elif self.ticket.stopping and not self.done:
            self.stop_reason = "stop"

    def fail(self, error: BaseException) -> None:
        """End the request with `error` (its budget is released when it retires)."""
        if not self.done:
            self.stop_reason = "error"
            self.ticket.finish(None, error)


@dataclass(eq=False)
class InFlight:
    """An engine's requests in flight and their prefix groups (admission adds to them and
    retires from them; residency and recovery read them)."""

    running: list[Running] = field(default_factory=list)
    groups: dict[int, PrefixGroup] = field(default_factory=dict)
    """id(prefix) -> its group."""

    def group_reading(self, source: FullKVSource) -> PrefixGroup | None:
        """The group whose prefix KV comes from `source`, if any."""
        return next((g for g in self.groups.values() if g.source is source), None)

    def fail_group(self, group: PrefixGroup, error: BaseException) -> None:
        """Fail every request over `group`."""
        for r in self.running:
            if r.group is group:
                r.fail(error)


def grouped(items: Iterable[T], group_of: Callable[[T], object]) -> list[T]:
    """`items` reordered so each group's items are adjacent, groups in order of first
    appearance (a pass then stages each prefix layer once)."""
    items = list(items)
    ranks: dict[int, int] = {}
    for item in items:
        ranks.setdefault(id(group_of(item)), len(ranks))
    return sorted(items, key=lambda item: ranks[id(group_of(item))])
