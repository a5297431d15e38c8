"""The decode loop: full-KV, lossy, and VeriCache (draft/verify), with continuous batching.

A request is a cached prefix (its full KV behind a `FullKVSource`, plus the queries its
prefill observed) and at least one suffix token. Requests are submitted at any time and
admitted under the engine's KV byte budget; each `step` admits what fits, prefills the new
requests' suffixes in exact mode against the full prefix (streamed layer by layer), and
advances every request in flight by one iteration:

- `full`: the prefix's full KV is read once and kept resident, shared by every request over
  that prefix, and decoded with in exact mode one token per step (the baseline every
  lossless claim is measured against);
- `lossy`: decodes with the compressed prefix plus the tail alone, one token per step in
  the draft runner mode (what users of KV compression run today; not lossless);
- `vericache`: rounds of `x` drafted tokens (compressed prefix + tail) and one exact
  verification of `x + 1` tokens over the full prefix (streamed) + tail. The longest run
  of drafts equal to the verifier's own choices is accepted, plus the verifier's next
  token; everything after it is rolled back, and the accepted tokens' verified KV
  replaces their draft KV. Only verifier choices are ever emitted.

Scheduling (DESIGN.md section 4): requests over one prefix share its compressed copy and
verify together in one pass over one pulled copy of it; the pull of the next verification
starts (`LayerRing.begin`) before the draft step that precedes it; rounds of requests over
different prefixes are staggered so their verifications (and pulls) fall in different
iterations while passes wait on the link, and aligned into one pass while compute is the
bottleneck (one pass then reads the weights once for every request); the horizon adapts
per request, shared by the requests that verify together. When a prefix's full KV cannot
be read, the engine recomputes it locally if the budget allows, else fails the requests
over it with `Unreachable`; tokens already emitted were verified, and nothing else is.

Failures stay with the requests they belong to (`Engine.step`): an error in one request's
admission (a compressed artifact that does not fit the model fails it with
`ArtifactFormatError`), its own sampling, listener or draft tail fails that request alone; a
draft pass that fails is retried prefix by prefix, and a prefix whose drafting still fails
fails its own requests. Only a failure of a pass shared by several prefixes (a bug) fails
the requests in flight, and the engine goes on serving the queue and later requests.

Tokens are chosen by `decoder.sampling.Sampler`, keyed by output position, so the tokens
of `vericache` are exactly the tokens of `full` (greedy or seeded sampling), whatever the
batch, horizon, compressor, or where the prefix KV came from.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from decoder.budget import KVBudget, OverBudget
from decoder.compressors import CompressedKV, CompressorPipeline, parse_compressor
from decoder.compressors.artifact import validate
from decoder.config import Mode, ceil_to
from decoder.draft_cache import DraftCache, DraftPrefix, DraftScratch
from decoder.generate import GenerationResult
from decoder.horizon import Acceptance, CostModel, HorizonPolicy
from decoder.kv_cache import KVCache
from decoder.kv_source import FullKVSource, LocalKVSource
from decoder.runner import Logits, ModelRunner, SeqInput
from decoder.sampling import Sampler, SamplingParams
from decoder.staging import LayerRing, PassGroup, PrefixUnavailable
from decoder.views import SharedPrefixView

log = logging.getLogger(__name__)
EngineMode = Literal["full", "lossy", "vericache"]
ENGINE_MODES: tuple[EngineMode, ...] = ("full", "lossy", "vericache")


@dataclass
class Prefix:
    """A cached prefix: its tokens, its full KV source, and what its prefill observed."""

    tokens: list[int]
    source: FullKVSource
    observed: list[torch.Tensor] | None = None
    """Per layer, the rotated queries of the prefix's last tokens ([w, H, D])."""
    artifacts: dict[str, CompressedKV] = field(default_factory=dict)
    """Compressed KV per canonical compressor spec, built once and shared by requests. One
    put here by the caller (e.g. fetched from the store) is validated against the model
    before use; one that does not fit fails the requests over it (ArtifactFormatError)."""

    def __post_init__(self) -> None:
        if self.source.length != len(self.tokens):
            raise ValueError(
                f"prefix has {len(self.tokens)} tokens but its KV source holds {self.source.length}"
            )


@dataclass
class Request:
    """One generation: a cached prefix and the prompt tokens after it (at least one)."""

    prefix: Prefix
    suffix: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    horizon: int | None = None
    """Drafted tokens per verification for this request; None follows the engine's config."""

    def __post_init__(self) -> None:
        if not self.suffix:
            raise ValueError("a request needs at least one prompt token after its prefix")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.horizon is not None and self.horizon < 0:
            raise ValueError(f"horizon must be >= 0, got {self.horizon}")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine decodes."""

    mode: EngineMode = "vericache"
    compressor: str = "snapkv:budget=0.125"
    """Compressor spec for `lossy` and `vericache` (see `decoder.compressors`)."""
    horizon: int | None = None
    """Drafted tokens per verification; None chooses per request (auto)."""
    max_horizon: int = 32
    """Upper bound of the automatic horizon."""
    draft_mode: Mode = "fast"
    """Runner mode of draft steps (and of lossy decoding)."""
    kv_budget: int | None = None
    """KV bytes the engine may hold (None: unlimited); admission waits for room."""
    staging_depth: int = 2
    """Layers of full prefix KV staged (and prefetched) at once for exact passes."""
    stagger: bool | None = None
    """Spread verifications of requests over different prefixes across iterations (True),
    or align every request's verification into one pass (False). None decides from
    measurements: stagger while passes wait on the pull of the full KV (a slow link), align
    while they do not (compute-bound: one pass reads the weights once for everyone)."""
    recompute: bool = True
    """Recompute a prefix locally when its full KV cannot be read (if the budget allows)."""

    def __post_init__(self) -> None:
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"mode must be one of {', '.join(ENGINE_MODES)}, got {self.mode!r}")
        if self.draft_mode not in ("exact", "fast"):
            raise ValueError(f"draft_mode must be 'exact' or 'fast', got {self.draft_mode!r}")
        if self.kv_budget is not None and self.kv_budget <= 0:
            raise ValueError(f"kv_budget must be > 0 bytes, got {self.kv_budget}")
        if self.staging_depth < 1:
            raise ValueError(f"staging_depth must be >= 1, got {self.staging_depth}")
        HorizonPolicy(self.horizon, self.max_horizon)  # validates both


def prefill_prefix(
    runner: ModelRunner, tokens: Sequence[int], observe: int = 128, room: int = 0
) -> Prefix:
    """Exact prefill of a prefix into host memory, keeping its last `observe` queries."""
    tokens = list(tokens)
    cache = runner.new_cache(capacity=len(tokens) + room)
    observed = None
    if tokens:
        seq = SeqInput.extend(cache, tokens, logits="none", observe=observe)
        runner.forward([seq], "exact")
        observed = seq.observed
    return Prefix(tokens, LocalKVSource(cache, len(tokens)), observed)


def split_prompt(
    runner: ModelRunner, prompt: Sequence[int], observe: int = 128
) -> tuple[Prefix, list[int]]:
    """An in-process prompt: everything but its last token becomes the cached prefix."""
    if not prompt:
        raise ValueError("every prompt needs at least one token")
    return prefill_prefix(runner, prompt[:-1], observe), list(prompt[-1:])


TokenListener = Callable[[list[int]], None]


class Ticket:
    """A submitted request: verified tokens reach `on_tokens` as they are accepted; `wait`
    returns the result (or raises the error that ended the request)."""

    def __init__(self, request: Request, on_tokens: TokenListener | None = None) -> None:
        self.request = request
        self.on_tokens = on_tokens
        self.submitted = time.perf_counter()
        self.on_done: Callable[[], None] | None = None
        """Called once, from the engine's thread, when the request has ended."""
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> GenerationResult:
        if not self._done.wait(timeout):
            raise TimeoutError("the request did not finish in time")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def cancel(self) -> None:
        """Ask the engine to drop the request (the caller went away); thread-safe."""
        self.cancelled = True

    def _finish(self, result: GenerationResult | None, error: BaseException | None) -> None:
        if self._done.is_set():
            return
        self.result, self.error = result, error
        self._done.set()
        if self.on_done is not None:
            try:
                self.on_done()
            except Exception:  # the request has ended either way
                log.exception("a request's on_done listener failed")


class Cancelled(Exception):
    """The request was cancelled by its caller."""


@dataclass(eq=False)
class _Group:
    """The requests in flight over one prefix, and what they share."""

    prefix: Prefix
    source: FullKVSource
    room: int  # tail tokens the shared buffers leave after the prefix
    members: int = 0
    charged: int = 0  # budget bytes of the shared part
    buffers: int = 0  # of which: the shared buffers (resident prefix, draft prefix)
    resident: KVCache | None = None  # full mode: the prefix's full KV (+ room)
    draft: DraftPrefix | None = None
    local: bool = False  # recomputed here after the store failed

    @property
    def capacity(self) -> int:
        return self.source.length + self.room

    def pass_group(self) -> PassGroup:
        return PassGroup(self.source, self.capacity)


@dataclass(eq=False)
class _Active:
    """A request in flight."""

    ticket: Ticket
    group: _Group
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
    stats: dict[str, float] = field(
        default_factory=lambda: {
            "verifications": 0,
            "drafted": 0,
            "accepted": 0,
            "draft_steps": 0,
            "pulled_bytes": 0.0,
            "compress_s": 0.0,
            "prefill_s": 0.0,
        }
    )
    timers: dict[str, float] = field(default_factory=dict)  # engine timers at admission
    decode_start: float = 0.0
    stop_reason: str = ""

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
            elif self.remaining <= 0:
                self.stop_reason = "length"
        if taken and self.ticket.on_tokens is not None:
            self.ticket.on_tokens(self.out[-taken:])
        return taken


class Engine:
    """Decodes requests with one runner under one KV budget. `submit` is thread-safe; one
    thread calls `step` (or `run`, which submits a batch and steps until it is done)."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        budget: KVBudget | None = None,
    ) -> None:
        """budget: shared with other engines of the same worker; default: one of
        `config.kv_budget` bytes for this engine alone."""
        self.runner = runner
        self.config = config or EngineConfig()
        self.eos = frozenset(eos_token_ids)
        self.pipeline: CompressorPipeline | None = (
            None if self.config.mode == "full" else parse_compressor(self.config.compressor)
        )
        self.policy = HorizonPolicy(self.config.horizon, self.config.max_horizon)
        self.costs = CostModel()
        self.budget = budget if budget is not None else KVBudget(self.config.kv_budget)
        c = runner.config
        self.ring = LayerRing(c, runner.rc.key_chunk, self.config.staging_depth)
        self._ring_charged = 0
        self.scratch = DraftScratch(c.num_kv_heads, c.head_dim)
        self._scratch_charged = 0
        self.timers: dict[str, float] = {
            "draft_s": 0.0,
            "draft_steps": 0,
            "verify_s": 0.0,
            "verify_passes": 0,
            "full_s": 0.0,
            "full_steps": 0,
            "steps": 0,
        }
        self.peak_staging_bytes = 0
        self._queue: deque[Ticket] = deque()
        self._lock = threading.Lock()
        self._active: list[_Active] = []
        self._groups: dict[int, _Group] = {}  # id(prefix) -> group
        self._iteration = 0

    # -- public API -------------------------------------------------------------------------

    @property
    def observe_window(self) -> int:
        """Prefix queries a prefill must keep for this engine's compressor."""
        return self.pipeline.observe_window if self.pipeline else 0

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._active or self._queue)

    @property
    def in_flight(self) -> int:
        return len(self._active)

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

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

    def submit(self, request: Request, on_tokens: TokenListener | None = None) -> Ticket:
        ticket = Ticket(request, on_tokens)
        with self._lock:
            self._queue.append(ticket)
        return ticket

    def run(self, requests: Sequence[Request]) -> list[GenerationResult]:
        """Decode every request to its stop; results in request order."""
        if not requests:
            raise ValueError("run needs at least one request")
        tickets = [self.submit(r) for r in requests]
        while not all(t.done for t in tickets):
            self.step()
        return [t.wait() for t in tickets]

    def step(self) -> bool:
        """Admit what fits, prefill the new requests, advance everything one iteration.
        Returns False when nothing could be done (the queue waits for room).

        Errors end requests, not the engine: one raised for one request (admission, its
        draft state, sampling, listener) or for the requests over one prefix (their draft
        pass) fails those alone; one raised by a pass shared by several prefixes fails the
        requests in flight. Either way the others, the queue and later submissions go on;
        a failed request's ticket raises its error."""
        self.runner.ensure_exact_supported()
        for a in self._active:
            if a.ticket.cancelled:
                self._fail(a, Cancelled("the request was cancelled"))
        fresh = self._admit_queued()
        live: list[_Active] = []
        try:
            if fresh:
                self._prefill(fresh)
            live = [a for a in self._active if not a.done]
            if live:
                self._advance(live)
        except Exception as error:  # not attributable to a request: a bug in a shared pass
            log.exception("an engine pass failed; failing the requests in flight")
            self.ring.cancel()
            for a in self._active:
                self._fail(a, error)
        self._retire()
        return bool(fresh or live)

    def close(self) -> None:
        """Stop the prefetch reader and fail whatever is still queued or in flight."""
        self.abort(RuntimeError("the engine was closed"))

    def abort(self, error: BaseException) -> None:
        """Fail everything queued or in flight with `error`. The engine stays usable:
        requests submitted afterwards are served."""
        self.ring.cancel()
        with self._lock:
            queued, self._queue = list(self._queue), deque()
        for t in queued:
            t._finish(None, error)
        for a in self._active:
            self._fail(a, error)
        self._retire()

    def _advance(self, live: list[_Active]) -> None:
        {
            "full": self._full_step,
            "lossy": self._lossy_step,
            "vericache": self._vericache_step,
        }[self.config.mode](live)
        self._iteration += 1

    @staticmethod
    def _fail(a: _Active, error: BaseException) -> None:
        """End a request in flight with `error` (its budget is released by `_retire`)."""
        if not a.done:
            a.stop_reason = "error"
            a.ticket._finish(None, error)

    def _each(self, actives: list[_Active], values: Sequence, work: Callable) -> None:
        """`work(a, value)` for each request still running; an error fails that one alone."""
        for a, value in zip(actives, values, strict=True):
            if a.done:
                continue
            try:
                work(a, value)
            except Exception as error:
                log.warning("a request failed alone: %r", error, exc_info=True)
                self._fail(a, error)

    # -- admission --------------------------------------------------------------------------

    def _tail_capacity(self, req: Request) -> int:
        return len(req.suffix) + req.max_new_tokens + self.config.max_horizon + 1

    def _token_bytes(self) -> int:
        """Bytes of one token's full KV over all layers."""
        c = self.runner.config
        return c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4

    def _own_bytes(self, tail_capacity: int) -> int:
        c = self.runner.config
        granule = self.runner.rc.key_chunk
        tail = ceil_to(tail_capacity, granule) * (self._token_bytes() + 8 * c.num_layers)
        if self.pipeline is None:
            return tail
        per_token = c.num_layers * c.num_kv_heads * (2 * c.head_dim * 4 + 8)
        return tail + tail_capacity * per_token

    def _admit_queued(self) -> list[_Active]:
        with self._lock:
            cancelled = [t for t in self._queue if t.cancelled]
            if cancelled:
                self._queue = deque(t for t in self._queue if not t.cancelled)
        for ticket in cancelled:
            ticket._finish(None, Cancelled("the request was cancelled"))
        if not self._active:
            self._release_idle_buffers()  # a waiting request must not wait on our own staging
        fresh = []
        while True:
            with self._lock:
                if not self._queue:
                    break
                ticket = self._queue[0]
            try:
                active = self._try_admit(ticket)
            except Exception as error:  # this request can never run: fail it, go on
                with self._lock:
                    self._queue.popleft()
                ticket._finish(None, error)
                continue
            if active is None:
                break  # head of the queue waits for room (first come, first served)
            with self._lock:
                self._queue.popleft()
            self._active.append(active)
            fresh.append(active)
        return fresh

    def _release_idle_buffers(self) -> None:
        """Nothing in flight: staging and the decode scratch go back to the budget."""
        if self._ring_charged or self._scratch_charged:
            self.ring.drop()
            self.scratch.drop()
            self.budget.release(self._ring_charged + self._scratch_charged)
            self._ring_charged = self._scratch_charged = 0

    def _try_admit(self, ticket: Ticket) -> _Active | None:
        req = ticket.request
        self._check_suffix(req)
        capacity = self._tail_capacity(req)
        group = self._groups.get(id(req.prefix))
        new_group = group is None
        t0 = time.perf_counter()
        if group is None:
            self._check_artifact(req.prefix)
            group = _Group(req.prefix, req.prefix.source, room=capacity)
        own = self._own_bytes(capacity)
        buffers = self._buffers_growth(group, max(group.room, capacity))
        # A prefix held in local memory (prefilled here, not in the store) counts too.
        local = isinstance(group.source, LocalKVSource) and new_group
        shared = buffers + (group.source.nbytes if local else 0)
        scratch = self._scratch_growth(group, max(group.room, capacity))
        staging = self._staging_growth(group.source.length + max(group.room, capacity))
        need = own + shared + scratch + staging
        if not self.budget.try_reserve(need):
            # With nothing of ours in flight, `need` is what the request needs on its own.
            if not self._active and self.budget.limit is not None and need > self.budget.limit:
                raise OverBudget(
                    f"the request needs {need} bytes of KV but the decoder's budget is "
                    f"{self.budget.limit} bytes"
                )
            return None
        room = group.room
        try:
            if new_group or capacity > group.room:
                group.room = max(group.room, capacity)
                self._build_shared(group, new_group)
            tail = KVCache(self.runner.config, granule=self.runner.rc.key_chunk, capacity=capacity)
            draft = DraftCache(group.draft, capacity) if group.draft is not None else None
        except BaseException:
            group.room = room
            self.budget.release(need)
            raise
        group.charged += shared
        group.buffers += buffers
        self._ring_charged += staging
        self._scratch_charged += scratch
        if new_group:
            self._groups[id(req.prefix)] = group
        group.members += 1
        active = _Active(
            ticket,
            group,
            Sampler(req.sampling),
            tail,
            self.eos,
            charged=own,
            admitted=time.perf_counter(),
            timers=dict(self.timers),
        )
        active.draft = draft
        if new_group and self.config.mode == "full" and not group.local:
            active.stats["pulled_bytes"] += group.source.nbytes  # the resident copy's pull
        active.stats["compress_s"] = time.perf_counter() - t0
        return active

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

    def _buffers_growth(self, group: _Group, room: int) -> int:
        """Budget bytes the group's shared buffers grow by to hold `room` tail tokens."""
        if self.config.mode == "full":
            cap = ceil_to(group.source.length + room, self.runner.rc.key_chunk)
            return cap * (self._token_bytes() + 8 * self.runner.config.num_layers) - group.buffers
        per_token = self._draft_token_bytes()
        total = 0
        for layer in self.compressed(group.prefix).layers:
            total += layer.nbytes if layer.quantized else (layer.kept + room) * per_token
        return total - group.buffers

    def _scratch_growth(self, group: _Group, room: int) -> int:
        """Budget bytes the shared decode buffer of quantized prefixes grows by."""
        if self.config.mode == "full":
            return 0
        layers = self.compressed(group.prefix).layers
        if not any(layer.quantized for layer in layers):
            return 0
        widest = max(layer.kept for layer in layers) + room
        return max(0, widest * self._draft_token_bytes() - self._scratch_charged)

    def _draft_token_bytes(self) -> int:
        """Bytes of one token in one layer of a draft buffer (keys, values, positions)."""
        c = self.runner.config
        return c.num_kv_heads * (2 * c.head_dim * 4 + 8)

    def _build_shared(self, group: _Group, new_group: bool) -> None:
        if self.config.mode == "full":
            self._load_resident(group)
            return
        c = self.runner.config
        if group.draft is None:
            group.draft = DraftPrefix(
                self.compressed(group.prefix), c.num_kv_heads, c.head_dim, self.scratch
            )
        group.draft.ensure_room(group.room)

    def _staging_growth(self, capacity: int) -> int:
        if self.config.mode == "full":
            return 0
        return max(0, self.ring.bytes_for(capacity) - self._ring_charged)

    def _load_resident(self, group: _Group) -> None:
        """Full mode: read the prefix's full KV into memory once, with tail room."""
        p = group.source.length
        old = group.resident
        cache = self.runner.new_cache(capacity=p + group.room)
        for index, layer in enumerate(cache.layers):
            layer.positions[:] = torch.arange(layer.capacity)
            if old is not None:
                layer.k[:, :p] = old.layers[index].k[:, :p]
                layer.v[:, :p] = old.layers[index].v[:, :p]
        if old is None:
            try:
                for index, layer in enumerate(cache.layers):
                    group.source.read_layer(index, layer.k[:, :p], layer.v[:, :p])
            except Exception as error:
                if not self._recompute_into(group, cache, error):
                    raise Unreachable(
                        f"the prefix's full KV is unreachable ({error}) and cannot be "
                        "recomputed here; no token was sent"
                    ) from error
        group.resident = cache

    # -- exact passes -----------------------------------------------------------------------

    def _exact_pass(self, entries: list[tuple[_Active, list[int], Logits]]) -> list:
        """One exact forward over requests' new tokens against their full prefix KV.

        Entries are ordered by prefix group so each prefix layer is staged once. When a
        prefix cannot be read, the pass is undone, the prefix recomputed (or its requests
        failed) and the pass retried. Returns logits per entry (None for failed ones)."""
        order = _grouped(range(len(entries)), lambda i: entries[i][0].group)
        result: list = [None] * len(entries)
        pending = [i for i in order if not entries[i][0].done]
        while pending:
            groups = list(dict.fromkeys(entries[i][0].group for i in pending))
            before = {i: len(entries[i][0].tail) for i in pending}
            seqs = [self._view(entries[i], groups) for i in pending]
            if self.config.mode != "full":
                self.ring.begin([g.pass_group() for g in groups])
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
            for g in groups:
                users = [i for i in pending if entries[i][0].group is g]
                if self.config.mode != "full":
                    for i in users:
                        entries[i][0].stats["pulled_bytes"] += g.source.nbytes / len(users)
            for i, lg in zip(pending, logits, strict=True):
                result[i] = lg
            break
        return result

    def _view(self, entry: tuple[_Active, list[int], Logits], groups: list[_Group]) -> SeqInput:
        a, tokens, logits = entry
        g = a.group
        if self.config.mode == "full":
            resident = g.resident

            def layers(i: int, resident=resident):
                return resident.layers[i]
        else:
            rank = groups.index(g)

            def layers(i: int, rank=rank):
                return self.ring.take(rank, i)

        view = SharedPrefixView(layers, g.source.length, a.tail, prefix_id=g)
        return SeqInput.extend(view, tokens, logits)

    def _recover(self, error: PrefixUnavailable) -> None:
        """A prefix's full KV failed to arrive: recompute it locally, or fail its requests."""
        group = next((g for g in self._groups.values() if g.source is error.source), None)
        if group is None:
            raise error
        if self._recompute_into(group, None, error.cause):
            return
        reason = Unreachable(
            f"the prefix's full KV is unreachable ({error.cause}) and recomputing it locally "
            f"needs {group.source.nbytes} bytes the decoder's KV budget does not have; no "
            "unverified token was sent"
            if self.config.recompute
            else f"the prefix's full KV is unreachable ({error.cause})"
        )
        for a in self._active:
            if a.group is group:
                self._fail(a, reason)

    def _recompute_into(self, group: _Group, cache: KVCache | None, cause) -> bool:
        """Exact prefill of the group's prefix here (bitwise the KV the store held)."""
        if not self.config.recompute or group.local:
            return False
        p = group.source.length
        extra = (
            0
            if cache is not None
            else ceil_to(p, self.runner.rc.key_chunk)
            * (self._token_bytes() + 8 * self.runner.config.num_layers)
        )
        if not self.budget.try_reserve(extra):
            return False
        try:
            if cache is None:
                cache = self.runner.new_cache(capacity=p)
            tokens = group.prefix.tokens[:p]
            self.runner.forward([SeqInput.extend(cache, tokens, logits="none")], "exact")
        except BaseException:
            self.budget.release(extra)
            raise
        group.source = LocalKVSource(cache, p)
        group.charged += extra
        group.local = True
        return True

    # -- one iteration per mode -------------------------------------------------------------

    def _prefill(self, fresh: list[_Active]) -> None:
        t0 = time.perf_counter()
        logits = self._exact_pass([(a, a.req.suffix, "last") for a in fresh])
        seconds = time.perf_counter() - t0
        self._each(fresh, logits, lambda a, lg: self._start(a, lg, seconds))
        if self.config.mode == "vericache":
            self._plan_rounds([a for a in fresh if not a.done], self._iteration)

    def _start(self, a: _Active, logits: torch.Tensor, prefill_s: float) -> None:
        """A prefilled request: its first token, and its draft tail mirrors its exact one."""
        a.stats["prefill_s"] = prefill_s
        a.decode_start = time.perf_counter()
        a.emit([a.sampler.choose(logits[-1], 0)])
        if a.draft is not None:
            a.draft.copy_tail(a.tail, 0, len(a.tail))

    @staticmethod
    def _emit_next(a: _Active, logits: torch.Tensor) -> None:
        a.emit([a.sampler.choose(logits[-1], len(a.out))])

    def _full_step(self, live: list[_Active]) -> None:
        t0 = time.perf_counter()
        logits = self._exact_pass([(a, [a.last], "last") for a in live])
        self.timers["full_s"] += time.perf_counter() - t0
        self.timers["full_steps"] += 1
        self.timers["steps"] += 1
        self._each(live, logits, self._emit_next)

    def _lossy_step(self, live: list[_Active]) -> None:
        live = self._by_group(live)
        self.timers["steps"] += 1
        self._each(live, self._draft_forward(live, lambda a: a.last), self._emit_next)

    def _vericache_step(self, live: list[_Active]) -> None:
        """One draft step for every request still drafting, then one verification pass for
        every request whose round is drafted. Requests keep their own rounds, so a short
        horizon never waits for a long one; the next pass's pull starts before drafting."""
        drafting = [a for a in live if self._drafting(a)]
        upcoming = [a for a in live if a not in drafting or len(a.drafts) + 1 >= a.horizon]
        if upcoming:
            groups = self._by_group(upcoming)
            self.ring.begin([g.pass_group() for g in dict.fromkeys(a.group for a in groups)])
        if drafting:
            self._draft_step(drafting)
        ready = [a for a in live if not a.done and not self._drafting(a)]
        if ready:
            self._verify(ready)
            self._plan_rounds([a for a in ready if not a.done], self._iteration + 1)

    @staticmethod
    def _by_group(actives: list[_Active]) -> list[_Active]:
        return _grouped(actives, lambda a: a.group)

    def _plan_rounds(self, actives: list[_Active], start: int) -> None:
        """Plan the next rounds of requests that verified (or were admitted) together.

        Requests that should verify together again keep one automatic horizon (the median of
        their own choices): the requests over one prefix always (one pulled copy serves
        them), and all of them when verifications are aligned rather than staggered."""
        stagger = self._staggering()
        groups: dict[int, list[_Active]] = {}
        for a in actives:
            groups.setdefault(id(a.group) if stagger else 0, []).append(a)
        for members in groups.values():
            auto = [self.policy.choose(a.acceptance, self.costs) for a in members]
            common = int(statistics.median(auto))
            for a in members:
                horizon = common if a.req.horizon is None else a.req.horizon
                self._plan_round(a, start, horizon, stagger)

    def _staggering(self) -> bool:
        if self.config.stagger is not None:
            return self.config.stagger
        stats = self.ring.stats
        verify_s = self.timers["verify_s"]
        return verify_s > 0 and stats.stall_s > 0.1 * verify_s

    def _plan_round(self, a: _Active, start: int, horizon: int, stagger: bool) -> None:
        """Set the request's next horizon; its round drafts from iteration `start`."""
        horizon = max(0, min(horizon, a.remaining - 1))
        if horizon > 1:
            horizon = self._placed(a, start, horizon, stagger)
        a.horizon = horizon
        a.drafts = []
        a.verify_at = start + max(horizon, 1) - 1

    def _placed(self, a: _Active, start: int, horizon: int, stagger: bool) -> int:
        """Shorten a round (never lengthen it, at most by half) so that it verifies in the
        same pass as other requests: of its own prefix when staggering, else of any prefix;
        when staggering, or else in an iteration no other prefix verifies in."""
        planned: dict[int, set[int]] = {}
        for other in self._active:
            if other is not a and not other.done and other.out:
                planned.setdefault(other.verify_at, set()).add(id(other.group))
        lowest = max(1, horizon - horizon // 2)
        for h in range(horizon, lowest - 1, -1):
            verifying = planned.get(start + h - 1, ())
            if (id(a.group) in verifying) if stagger else verifying:
                return h
        if stagger:
            for h in range(horizon, lowest - 1, -1):
                if not planned.get(start + h - 1):
                    return h
        return horizon

    def _drafting(self, a: _Active) -> bool:
        return len(a.drafts) < a.horizon and not (a.drafts and a.drafts[-1] in self.eos)

    def _draft_step(self, drafting: list[_Active]) -> None:
        t0 = time.perf_counter()
        drafting = self._by_group(drafting)
        logits = self._draft_forward(drafting, lambda a: a.drafts[-1] if a.drafts else a.last)
        self._each(drafting, logits, self._add_draft)
        seconds = time.perf_counter() - t0
        self.costs.record_draft_step(seconds, len(drafting))
        self.timers["draft_s"] += seconds
        self.timers["draft_steps"] += 1
        self.timers["steps"] += 1

    @staticmethod
    def _add_draft(a: _Active, logits: torch.Tensor) -> None:
        a.drafts.append(a.sampler.choose(logits[-1], len(a.out) + len(a.drafts)))
        a.stats["draft_steps"] += 1

    def _draft_forward(self, actives: list[_Active], token_of: Callable[[_Active], int]) -> list:
        """One draft-mode forward of one token per request (grouped by prefix); logits per
        request. A failure is pinned on a prefix: the batch is undone and each prefix's
        requests retried alone; those whose retry fails too fail with it (logits None)."""
        groups = list(dict.fromkeys(a.group for a in actives))
        try:
            return self._forward_drafts(actives, token_of)
        except Exception as error:
            if len(groups) == 1:
                log.warning("drafting over one prefix failed: %r", error, exc_info=True)
                for a in actives:
                    self._fail(a, error)
                return [None] * len(actives)
        logits = {}
        for g in groups:
            members = [a for a in actives if a.group is g]
            logits.update(
                zip(map(id, members), self._draft_forward(members, token_of), strict=True)
            )
        return [logits[id(a)] for a in actives]

    def _forward_drafts(self, actives: list[_Active], token_of: Callable[[_Active], int]) -> list:
        """One fast forward over the requests' draft caches, rolled back if it raises."""
        kept = [a.draft.tail_length for a in actives]
        seqs = [SeqInput.extend(a.draft, [token_of(a)]) for a in actives]
        try:
            return self.runner.forward(seqs, self.config.draft_mode)
        except Exception:
            for a, n in zip(actives, kept, strict=True):
                a.draft.truncate(n)
            raise

    def _verify(self, live: list[_Active]) -> None:
        t0 = time.perf_counter()
        kept = [len(a.tail) for a in live]
        logits = self._exact_pass([(a, [a.last, *a.drafts], "all") for a in live])
        seconds = time.perf_counter() - t0
        tokens = sum(len(a.drafts) + 1 for a in live)
        self.costs.record_verification(len(live), tokens, seconds)
        self.timers["verify_s"] += seconds
        self.timers["verify_passes"] += 1
        self._each(live, list(zip(logits, kept, strict=True)), lambda a, v: self._accept(a, *v))

    @staticmethod
    def _accept(a: _Active, logits: torch.Tensor, before: int) -> None:
        """Emit the verified run of drafts plus the verifier's next token, roll back the rest
        (`before`: the tail's length before the verification)."""
        choices = a.sampler.choose_rows(logits, len(a.out))
        accepted = 0
        while accepted < len(a.drafts) and a.drafts[accepted] == choices[accepted]:
            accepted += 1
        a.acceptance.record(len(a.drafts), accepted)
        a.stats["verifications"] += 1
        a.stats["drafted"] += len(a.drafts)
        a.stats["accepted"] += accepted
        taken = a.emit(choices[: accepted + 1])
        # Verified KV of the inputs [last, d_1 .. d_accepted] stays; the rest rolls back.
        a.tail.truncate(before + taken)
        a.draft.truncate(before)
        a.draft.copy_tail(a.tail, before, before + taken)

    # -- retirement and results ---------------------------------------------------------------

    def _retire(self) -> None:
        keep = []
        for a in self._active:
            if not a.done:
                keep.append(a)
                continue
            self.budget.release(a.charged)
            g = a.group
            g.members -= 1
            if g.members == 0:
                self.budget.release(g.charged)
                self._groups.pop(id(g.prefix), None)
            if a.stop_reason != "error":
                self._deliver(a)
        self._active = keep
        if not self._active:
            self._release_idle_buffers()

    def _deliver(self, a: _Active) -> None:
        try:
            result = self._result(a)
        except Exception as error:
            log.warning("a request's result failed: %r", error, exc_info=True)
            a.ticket._finish(None, error)
            return
        a.ticket._finish(result, None)

    def _result(self, a: _Active) -> GenerationResult:
        s = a.stats
        now = time.perf_counter()
        decode_s = now - a.decode_start
        busy = s["compress_s"] + s["prefill_s"] + decode_s
        group = a.group
        stats: dict[str, float | int | str] = {
            "mode": self.config.mode,
            "prefix_tokens": group.source.length,
            "prompt_tokens": group.source.length + len(a.req.suffix),
            "generated_tokens": len(a.out),
            "compress_s": round(s["compress_s"], 4),
            "prefill_s": round(s["prefill_s"], 4),
            "decode_s": round(decode_s, 4),
            "queue_s": round(a.admitted - a.ticket.submitted, 4),
            "latency_s": round(now - a.ticket.submitted, 4),
            "tokens_per_s": round(len(a.out) / busy, 3) if busy > 0 else 0.0,
            "full_bytes": group.source.nbytes,
            "pulled_bytes": int(s["pulled_bytes"]),
            "peak_staging_bytes": self.peak_staging_bytes,
            "recomputed": group.local,
        }
        if a.req.sampling.temperature > 0:
            stats["seed"] = a.sampler.params.seed
        if group.draft is not None:
            compressed = group.draft.compressed
            stats.update(
                compressor=compressed.spec,
                compressed_bytes=compressed.nbytes,
                compression_ratio=round(compressed.ratio, 3),
            )
        if self.config.mode == "vericache":
            v = max(1, s["verifications"])
            stats.update(
                verifications=int(s["verifications"]),
                drafted=int(s["drafted"]),
                accepted=int(s["accepted"]),
                draft_steps=int(s["draft_steps"]),
                accepted_per_verification=round(s["accepted"] / v, 3),
                tokens_per_verification=round((len(a.out) - 1) / v, 3),
                fetch_s=round(self.ring.stats.read_s, 4),
                fetch_stall_s=round(self.ring.stats.stall_s, 4),
                draft_s=round(self.timers["draft_s"] - a.timers.get("draft_s", 0.0), 4),
                verify_s=round(self.timers["verify_s"] - a.timers.get("verify_s", 0.0), 4),
            )
        stats["batch_steps"] = int(self.timers["steps"] - a.timers.get("steps", 0))
        return GenerationResult(tokens=a.out, stop_reason=a.stop_reason or "length", stats=stats)


def _grouped(items, group_of) -> list:
    """`items` reordered so each group's items are adjacent, groups in order of first
    appearance (a pass then stages each prefix layer once)."""
    items = list(items)
    ranks: dict[int, int] = {}
    for item in items:
        ranks.setdefault(id(group_of(item)), len(ranks))
    return sorted(items, key=lambda item: ranks[id(group_of(item))])


class Unreachable(Exception):
    """A request's prefix KV can be neither read nor recomputed (maps to UNAVAILABLE)."""
