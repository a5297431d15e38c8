"""A decoder worker: the request flow of DESIGN.md section 4 over the prefix store.

Generate:
1. the longest cached prefix of the prompt is looked up with the caller's token (so a
   tenant finds exactly what it may read); its compressed artifact for the requested spec
   is fetched once per worker, or, when missing, built here once from the full KV and
   stored for every later request and worker;
2. the request joins the engine of its mode and spec, which prefills the rest of the
   prompt exactly against the full prefix KV streamed layer by layer, then drafts and
   verifies; requests over one prefix (one tenant's, or a shared namespace's) share its
   compressed copy and verify together over one pulled copy;
3. verified tokens are handed to the caller as they are accepted.

A prompt with no cached prefix is prefilled here (its KV is held locally, under the
budget) and decoded the same way. Publish prefills a prefix once, stores its full KV chunks
and one artifact per requested compressor.

Memory (DESIGN.md section 4): everything the worker keeps is charged to the KV budget or
bounded by its own limit. A local prefill reserves its KV before it runs (waiting for room)
and hands the reservation to the engine's admission. Cached prefixes are charged for their
compressed artifacts; idle ones are dropped least recently used first beyond
`prefix_cache`, or whenever a reservation needs their bytes. Engines (one per mode,
compressor spec and n-gram setting) are kept for `max_engines` specs; idle ones beyond that
are closed least recently used first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import resource
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import torch
from vericache.v1 import decoder_pb2 as dpb

from decoder.budget import KVBudget
from decoder.compressors import CompressedKV, parse_compressor
from decoder.compressors.artifact import ArtifactFormatError, from_bytes, to_bytes, validate
from decoder.config import RunnerConfig
from decoder.engine import ENGINE_MODES, Engine, EngineConfig, Prefix, Request, prefill_prefix
from decoder.errors import Cancelled, OverBudget
from decoder.kv_source import FullKVSource
from decoder.loader import LoadedModel, load_runner
from decoder.runner import ModelRunner, SeqInput
from decoder.sampling import SamplingParams
from decoder.service.audit import Auditor, Sample
from decoder.service.clients import StoreClients
from decoder.service.config import MAX_NGRAM, DecoderConfig
from decoder.service.metrics import DecoderMetrics
from decoder.service.scheduler import Scheduler
from decoder.service.status import BadRequest
from decoder.store_source import StoreKVSource, kv_layout
from prefix_store.client import CachedPrefix, StoreClient
from prefix_store.errors import StoreError
from prefix_store.provenance import Signer, read_key, trusted_prefix

log = logging.getLogger(__name__)
_DONE = object()
LOCAL_PREFILL_POLL_S = 0.05
"""How often a prompt to prefill here looks again for room in the budget."""


@dataclass(eq=False)
class _Entry:
    """A prefix this worker knows, shared by every request over it."""

    prefix: Prefix
    cached: CachedPrefix | None  # None: prefilled here (not in the store)
    users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    unsigned: bool = False
    """Over KV no decoder signed (the caller opted in): what is built from it is not signed."""
    charged: int = 0
    """Budget bytes the entry holds itself: its compressed artifacts."""
    prepaid: int = 0
    """A local prefill's reserved KV bytes, until its request takes them over."""


@dataclass(eq=False)
class _EngineSlot:
    engine: Engine
    users: int = 0
    """Requests that obtained the engine and have not ended (it is not closed under them)."""


@dataclass
class GenerateSpec:
    """A validated Generate request."""

    prompt: list[int]
    namespace: str
    mode: str
    compressor: str
    max_new_tokens: int
    sampling: SamplingParams
    horizon: int | None
    use_unsigned_prefix: bool = False
    """Verify against the caller's own unsigned KV too (its private namespace only)."""
    ngram: int = 0
    """Prompt-lookup guesses per forward (0: off)."""


class DecoderWorker:
    def __init__(self, config: DecoderConfig, model: LoadedModel | None = None) -> None:
        """model: an already loaded model to serve (default: load `config.model`)."""
        self.config = config
        rc = RunnerConfig(threads=config.threads)
        if model is None:  # its own: loaded into the runner layer by layer, held once
            self.model, self.runner = load_runner(config.model, rc, draft=True)
        else:  # a caller's, shared with others (tests): they hold the weights anyway
            self.model, self.runner = model, ModelRunner(model.config, model.weights, rc)
        self.runner.ensure_exact_supported()
        self.layout = kv_layout(self.model.config, self.model.fingerprint)
        self.signer = self._signer(config)
        self._max_token_chars = max(map(len, self.model.tokenizer.get_vocab()))
        """The longest token's text: a text longer than this times the context cannot fit."""
        self.budget = KVBudget(config.kv_budget)
        self.scheduler = Scheduler()
        self._engines: OrderedDict[tuple[str, str, int], _EngineSlot] = OrderedDict()
        self._prefixes: OrderedDict[tuple, _Entry] = OrderedDict()
        self.budget.add_reclaimer(self._reclaim_idle_prefix)
        self._clients = StoreClients(
            config.store_endpoints,
            config.client,
            config.store_clients,
            config.auth_recheck_s,
            self._clients_in_use,
        )
        self._lock = threading.Lock()
        parse_compressor(config.default_compressor)  # fail at start-up, not per request
        self.metrics = DecoderMetrics(self, config.metrics.tenant_labels if config.metrics else 32)
        audits, replay = self.metrics.audits, weakref.WeakMethod(self._replay)
        self.auditor = Auditor(  # holds the worker weakly: no cycle keeps its model alive
            config.audit_rate,
            lambda sample: replay()(sample),
            lambda result: audits.labels(result).inc(),
            config.audit_queue,
        )

    @staticmethod
    def _signer(config: DecoderConfig) -> Signer:
        if config.provenance_key_file is not None:
            return read_key(config.provenance_key_file)
        if config.provenance_key is not None:
            return Signer(config.provenance_key)
        log.warning(
            "decoder %s: no deployment provenance key; it trusts only KV it publishes itself",
            config.worker_id,
        )
        return Signer.generate()

    def close(self) -> None:
        self.auditor.close()
        self.scheduler.stop()
        self._clients.close()

    # -- Info -----------------------------------------------------------------------------

    def info(self) -> dpb.InfoResponse:
        with self._lock:
            engines = [slot.engine for slot in self._engines.values()]
            cached = sum(e.charged for e in self._prefixes.values() if e.users == 0)
            prefixes = len(self._prefixes)
        return dpb.InfoResponse(
            model_id=self.layout.model_id,
            worker_id=self.config.worker_id,
            kv_budget=self.budget.limit or 0,
            kv_used=self.budget.used,
            in_flight=sum(e.in_flight for e in engines),
            queued=sum(e.queued for e in engines),
            default_compressor=self.config.default_compressor,
            kv_cached=cached,
            cached_prefixes=prefixes,
            engines=len(engines),
            weight_bytes=self.runner.weight_bytes,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )

    # -- Generate ---------------------------------------------------------------------------

    def parse_generate(self, request: dpb.GenerateRequest) -> GenerateSpec:
        """The request validated: every cheap field first, the prompt (tokenized) last."""
        mode = request.mode or "vericache"
        if mode not in ENGINE_MODES:
            raise BadRequest(f"mode {mode!r} is unknown; choose from: {', '.join(ENGINE_MODES)}")
        compressor = parse_compressor(request.compressor or self.config.default_compressor).spec
        if not 1 <= request.max_new_tokens <= self.config.max_new_tokens:
            raise BadRequest(
                f"max_new_tokens must be in [1, {self.config.max_new_tokens}], "
                f"got {request.max_new_tokens}"
            )
        sampling = self._sampling(request.sampling)
        horizon = request.horizon if request.HasField("horizon") else None
        if horizon is not None and horizon > 256:
            raise BadRequest(f"horizon must be <= 256, got {horizon}")
        ngram = request.ngram if request.HasField("ngram") else self.config.ngram
        if ngram > MAX_NGRAM:
            raise BadRequest(f"ngram must be <= {MAX_NGRAM}, got {ngram}")
        prompt = self._prompt_ids(request)
        if len(prompt) < 2:
            raise BadRequest("prompt: at least 2 tokens are needed (a prefix and one more)")
        limit = self.model.config.max_position_embeddings
        if len(prompt) + request.max_new_tokens > limit:
            raise BadRequest(
                f"prompt ({len(prompt)} tokens) plus max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the model's context of {limit}"
            )
        if request.use_unsigned_prefix and request.namespace:
            raise BadRequest(
                "use_unsigned_prefix: only for the caller's private namespace; a shared "
                "namespace is verified against signed KV only"
            )
        return GenerateSpec(
            prompt,
            request.namespace,
            mode,
            compressor,
            request.max_new_tokens,
            sampling,
            horizon,
            request.use_unsigned_prefix,
            ngram,
        )

    @staticmethod
    def _sampling(s: dpb.Sampling) -> SamplingParams:
        """The request's sampling; top_p 0 is proto3's unset (off). Anything outside a
        field's range (NaN included) is INVALID_ARGUMENT naming it, never quietly off."""
        try:
            return SamplingParams(
                s.temperature,
                s.top_k,
                s.top_p if s.top_p != 0 else 1.0,
                s.seed if s.HasField("seed") else None,
            )
        except ValueError as error:
            raise BadRequest(f"sampling: {error}") from None

    def generate(
        self, token: str, spec: GenerateSpec, cancelled=lambda: False, observed: bool = True
    ) -> Iterator:
        """Yield (token ids, text) as tokens are verified, then the final (stop, stats).
        `observed`: count the request in the metrics and offer it to the audit (False for
        the audit's own replays)."""
        request_id = uuid.uuid4().hex[:12]
        client = self.client(token)
        prompt = spec.prompt[:-1]
        entry = self._entry(client, prompt, spec.namespace, spec.use_unsigned_prefix, cancelled)
        try:
            if spec.mode != "full":
                self._ensure_artifact(entry, spec.compressor, client)
            suffix = spec.prompt[entry.prefix.source.length :]
            with self._engine(spec.mode, spec.compressor, spec.ngram) as engine:
                events: queue.Queue = queue.Queue()
                request = Request(
                    entry.prefix,
                    suffix,
                    spec.max_new_tokens,
                    spec.sampling,
                    spec.horizon,
                    prepaid=entry.prepaid,
                )
                tenant = client.topology.tenant  # admission is fair between tenants
                ticket = self.scheduler.submit(engine, request, events.put, tenant)
                entry.prepaid = 0  # the ticket holds it now
                ticket.on_done = lambda: events.put(_DONE)
                cached = entry.cached.tokens if entry.cached is not None else 0
                extra = {"cached_tokens": cached, "request_id": request_id}
                done = (lambda *a: self._finished(token, tenant, spec, *a)) if observed else None
                yield from self._stream(ticket, events, cancelled, extra, done)
        finally:
            self._release(entry)

    def _finished(self, token: str, tenant: str, spec: GenerateSpec, result, stats: dict) -> None:
        """A request's last token is out: count it, and audit it when sampled (modes that
        claim full-KV outputs: vericache, and full with prompt-lookup guesses)."""
        self.metrics.finished(tenant, stats)
        lossless = spec.mode == "vericache" or (spec.mode == "full" and spec.ngram > 0)
        if not lossless or not self.auditor.sampled():
            return
        sampling = spec.sampling
        if "seed" in stats:  # the seed an unseeded sampling request was given
            sampling = dataclasses.replace(sampling, seed=stats["seed"])
        spec = dataclasses.replace(spec, sampling=sampling)
        self.auditor.offer(Sample(stats["request_id"], token, spec, tuple(result.tokens)))

    def _replay(self, sample: Sample) -> list[int]:
        """The audit's reference: the sample decoded in full mode, as its caller could."""
        spec = dataclasses.replace(sample.spec, mode="full", ngram=0, horizon=None)
        tokens: list[int] = []
        for event in self.generate(sample.token, spec, observed=False):
            if event[0] == "tokens":
                tokens.extend(event[1])
        return tokens

    def _stream(self, ticket, events: queue.Queue, cancelled, extra: dict, done=None) -> Iterator:
        try:
            yield from self._events(ticket, events, cancelled)
        finally:
            if not ticket.done:  # the caller went away: stop decoding for it
                ticket.cancel()
                self.scheduler.notify()
        if cancelled():
            return  # nobody to tell
        result = ticket.wait()  # raises the request's error
        stats = {
            "model": self.model.name,
            "worker": self.config.worker_id,
            "stop_reason": result.stop_reason,
            **result.stats,
            **extra,
        }
        if done is not None:
            done(result, stats)
        yield ("done", result.stop_reason, json.dumps(stats))

    def _events(self, ticket, events: queue.Queue, cancelled) -> Iterator:
        out: list[int] = []
        sent = ""
        while True:
            try:
                item = events.get(timeout=0.25)
            except queue.Empty:
                if cancelled() or (ticket.done and events.empty()):
                    return  # (the second: it ended before on_done was attached)
                continue
            if item is _DONE:
                return
            out.extend(item)
            text = self.model.decode(out)
            if text.endswith("\ufffd"):  # an incomplete character: wait for the rest
                piece = ""
            else:
                piece, sent = text[len(sent) :], text
            yield ("tokens", item, piece)

    # -- Publish ----------------------------------------------------------------------------

    def publish(self, token: str, request: dpb.PublishRequest) -> dpb.PublishResponse:
        tokens = self._prompt_ids(request)
        if not tokens:
            raise BadRequest("prompt: the prefix is empty")
        pipelines = [parse_compressor(spec) for spec in request.compressors]
        client = self.client(token)
        observe = max([p.observe_window for p in pipelines] + [1])

        def work() -> dpb.PublishResponse:
            t0 = time.perf_counter()
            need = len(tokens) * self.model.config.kv_bytes_per_token
            self.budget.reserve(need)  # transient: the prefill's full KV
            try:
                prefix = prefill_prefix(self.runner, tokens, observe)
                prefill_s = time.perf_counter() - t0
                kv = []
                for index in range(self.layout.num_layers):
                    shape = (self.layout.num_kv_heads, len(tokens), self.layout.head_dim)
                    k, v = torch.empty(shape), torch.empty(shape)
                    prefix.source.read_layer(index, k, v)
                    kv.append((k, v))
                result = client.publish_prefix(
                    tokens, kv, self.layout, request.namespace, signer=self.signer
                )
                del kv
                specs = []
                for pipeline in pipelines:
                    compressed = self._compress(pipeline, prefix.source, prefix.observed)
                    data = to_bytes(compressed)
                    client.put_artifact(result.prefix, pipeline.spec, data, signer=self.signer)
                    specs.append(pipeline.spec)
            finally:
                self.budget.release(need)
            return dpb.PublishResponse(
                tokens=result.prefix.tokens,
                stored_bytes=result.stored_bytes,
                artifacts=specs,
                prefill_s=prefill_s,
            )

        return self.scheduler.call(work)

    # -- internals --------------------------------------------------------------------------

    def _prompt_ids(self, request) -> list[int]:
        """The prompt's token ids; INVALID_ARGUMENT for one that cannot fit the model's
        context (text too long for it is refused before it is tokenized)."""
        which = request.WhichOneof("prompt")
        limit = self.model.config.max_position_embeddings
        if which == "text":
            if not request.text:
                raise BadRequest("prompt: the text is empty")
            if len(request.text) > limit * self._max_token_chars:
                raise BadRequest(
                    f"prompt: {len(request.text)} characters cannot fit the model's context "
                    f"of {limit} tokens"
                )
            return self._fits(self.model.encode(request.text, chat=request.chat), limit)
        if which == "token_ids":
            self._fits(request.token_ids.ids, limit)  # its length, before any list is made
            ids = list(request.token_ids.ids)
            vocab = self.model.config.vocab_size
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise BadRequest(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
            return ids
        raise BadRequest("prompt: set text or token_ids")

    @staticmethod
    def _fits(ids: Sequence[int], limit: int) -> Sequence[int]:
        if len(ids) > limit:
            raise BadRequest(f"prompt: {len(ids)} tokens exceed the model's context of {limit}")
        return ids

    def client(self, token: str) -> StoreClient:
        """A store client acting as the caller (its token decides what it may read); the
        store's Unauthenticated for a token it does not know (then nothing is kept)."""
        return self._clients.get(token)

    def authenticate(self, token: str, peer: str = "") -> AbstractContextManager[StoreClient]:
        """`client(token)`, kept open until the block (a call) ends: a call authenticates
        with it before its request is read. `peer`: the caller's address, whose unknown
        tokens are throttled (`StoreClients`)."""
        return self._clients.held(token, peer)

    def cached_clients(self) -> int:
        """Store clients kept for later calls (at most `config.store_clients` when idle)."""
        return len(self._clients)

    def _clients_in_use(self) -> list[StoreClient]:
        """The clients cached prefixes read through (not closed while cached)."""
        with self._lock:
            return [e.prefix.source.client for e in self._prefixes.values() if e.cached is not None]

    @contextmanager
    def _engine(self, mode: str, compressor: str, ngram: int) -> Iterator[Engine]:
        """The engine of a mode and spec, kept while the block runs; afterwards idle
        engines beyond `max_engines` are closed, least recently used first."""
        key = (mode, compressor if mode != "full" else "", ngram)
        with self._lock:
            slot = self._engines.get(key)
            if slot is None:
                config = EngineConfig(
                    mode=mode,
                    compressor=compressor,
                    staging_depth=self.config.staging_depth,
                    ngram=ngram,
                    resident=self.config.resident_prefixes,
                    placement=self.config.placement,
                )
                engine = Engine(self.runner, config, self.model.eos_token_ids, self.budget)
                slot = self._engines[key] = _EngineSlot(engine)
                self.scheduler.add_engine(engine)
            self._engines.move_to_end(key)
            slot.users += 1
        try:
            yield slot.engine
        finally:
            with self._lock:
                slot.users -= 1
                idle = self._idle_engines()
            for engine in idle:
                self.scheduler.remove_engine(engine)

    def _idle_engines(self) -> list[Engine]:
        """Unused engines beyond `max_engines`, least recently used first, forgotten."""
        excess = len(self._engines) - self.config.max_engines
        idle = [k for k, s in self._engines.items() if not s.users and not s.engine.busy]
        return [self._engines.pop(key).engine for key in idle[: max(0, excess)]]

    def _entry(
        self,
        client: StoreClient,
        tokens: list[int],
        namespace: str,
        unsigned: bool = False,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> _Entry:
        """The prefix a request decodes over: the leading chunks of the longest cached prefix
        that this deployment's decoders signed (docs/DESIGN.md section 8); anything else
        stored for these tokens is never a verifier input, and is recomputed here. With
        `unsigned` (the caller's private namespace, its explicit choice) the whole cached
        prefix, kept apart from the signed one."""
        found = client.lookup(tokens, self.layout, namespace)
        cached = trusted_prefix(found, tokens, self.signer.verifier)
        unsigned = unsigned and cached.tokens < found.tokens
        if unsigned:
            cached = found
        elif cached.tokens < found.tokens:
            log.warning(
                "decoder %s: %d of %d cached tokens carry no valid signature; recomputing them",
                self.config.worker_id,
                found.tokens - cached.tokens,
                found.tokens,
            )
        if cached.tokens == 0:
            return self._local_entry(tokens, cancelled)
        owner = client.topology.tenant if not namespace else ""  # private: the caller's own
        key = (owner, cached.namespace, cached.key, cached.tokens, unsigned)
        with self._lock:
            entry = self._prefixes.get(key)
            if entry is None:
                source = StoreKVSource(client, cached)
                entry = _Entry(Prefix(tokens[: cached.tokens], source), cached, unsigned=unsigned)
                self._prefixes[key] = entry
            else:
                # One copy of a shared prefix for all its readers; its reads from now on go
                # through the latest reader's client (its quota, shares and audit), never a
                # first reader's, whose token may since have been rotated or removed.
                entry.prefix.source.client = client
            self._prefixes.move_to_end(key)
            entry.users += 1
            self._evict()
        return entry

    def _local_entry(self, tokens: list[int], cancelled: Callable[[], bool]) -> _Entry:
        """No cached prefix: prefill it here (held locally, not stored), once the budget
        has room for its KV; that reservation goes with the request to its admission."""
        need = len(tokens) * self.model.config.kv_bytes_per_token
        limit = self.budget.limit
        if limit is not None and need > limit:
            raise OverBudget(
                f"the prompt's KV needs {need} bytes but the decoder's budget is {limit} bytes"
            )

        def prefill() -> Prefix | None:  # on the model thread, between engine steps
            if not self.budget.try_reserve(need):
                return None
            try:
                return prefill_prefix(self.runner, tokens, 128)
            except BaseException:
                self.budget.release(need)
                raise

        while (prefix := self.scheduler.call(prefill)) is None:
            if cancelled():
                raise Cancelled("the request was cancelled while waiting for room")
            time.sleep(LOCAL_PREFILL_POLL_S)  # requests in flight free their bytes
        return _Entry(prefix, None, users=1, prepaid=need)

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.users -= 1
            if entry.cached is None:  # a local prefill: nobody else has it
                self._forget(entry)
            self._evict()

    def _evict(self) -> None:
        idle = [k for k, e in self._prefixes.items() if e.users == 0]
        for key in idle[: max(0, len(self._prefixes) - self.config.prefix_cache)]:
            self._forget(self._prefixes.pop(key))

    def _forget(self, entry: _Entry) -> None:
        """An entry leaves the worker: the bytes it holds go back to the budget."""
        self.budget.release(entry.charged + entry.prepaid)
        entry.charged = entry.prepaid = 0

    def _reclaim_idle_prefix(self) -> bool:
        """The budget's reclaimer: drop the least recently used idle cached prefix."""
        with self._lock:
            key = next((k for k, e in self._prefixes.items() if e.users == 0), None)
            if key is None:
                return False
            self._forget(self._prefixes.pop(key))
            return True

    def _ensure_artifact(self, entry: _Entry, spec: str, client: StoreClient) -> CompressedKV:
        """The prefix's compressed KV for `spec`: cached, fetched, or built once and stored
        (as the caller, `client`: its quota pays, its role must let it write).

        Only an artifact signed by this deployment's decoders is fetched (another is as
        good as missing: docs/DESIGN.md section 8).

        A fetched artifact is used only if it fits this model and prefix (`validate`: layers,
        heads, dims, dtypes, length, positions). One that does not (any writer of the prefix
        may have stored it) is treated as missing: logged, never cached, rebuilt here from
        the full KV (always correct) and stored in its place, so the request is served as on
        a miss instead of failing, and no later request or worker meets it again."""
        with entry.lock:
            prefix = entry.prefix
            if spec in prefix.artifacts:
                return prefix.artifacts[spec]
            compressed = None
            if entry.cached is not None:
                data = client.fetch_artifact(entry.cached, spec, self.signer.verifier)
                try:
                    if data is not None:
                        compressed = from_bytes(data)
                        validate(compressed, self.layout, prefix.source.length, spec)
                except ArtifactFormatError as error:
                    log.warning("stored artifact %s is unusable (%s); rebuilding it", spec, error)
                    compressed = None
            if compressed is None:
                compressed = self.scheduler.call(lambda: self._build_artifact(entry, spec))
                if entry.cached is not None:
                    signer = None if entry.unsigned else self.signer
                    self._store_artifact(client, entry.cached, spec, compressed, signer)
            self.scheduler.call(lambda: self.budget.reserve(compressed.nbytes))
            entry.charged += compressed.nbytes
            prefix.artifacts[spec] = compressed
            return compressed

    def _build_artifact(self, entry: _Entry, spec: str) -> CompressedKV:
        """The prefix's compressed KV for `spec`, from what its prefill observed when that
        covers the compressor's window (else the window is observed again, exactly).

        A stored prefix whose full KV cannot be read any more (evicted or deleted since the
        lookup, its shards gone) is recomputed here, exactly, as on a miss: the request is
        served, never failed NOT_FOUND (the engine does the same for its own reads)."""
        pipeline = parse_compressor(spec)
        try:
            return self._compress_prefix(pipeline, entry.prefix)
        except StoreError as error:
            if entry.cached is None:
                raise
            log.warning("a cached prefix's full KV is unreadable (%s); recomputing it", error)
            return self._compress_recomputed(pipeline, entry.prefix)

    def _compress_prefix(self, pipeline, prefix: Prefix) -> CompressedKV:
        observed = prefix.observed
        if not pipeline.observes_enough(observed, prefix.source.length):
            observed = self._observe(prefix, pipeline.observe_window)
        return self._compress(pipeline, prefix.source, observed)

    def _compress_recomputed(self, pipeline, prefix: Prefix) -> CompressedKV:
        """`_compress_prefix` over the prefix's KV recomputed here (transient, budgeted)."""
        need = prefix.source.length * self.model.config.kv_bytes_per_token
        self.budget.reserve(need)
        try:
            local = prefill_prefix(self.runner, list(prefix.tokens), pipeline.observe_window)
            return self._compress_prefix(pipeline, local)
        finally:
            self.budget.release(need)

    def _store_artifact(self, client, cached: CachedPrefix, spec: str, compressed, signer) -> None:
        """Store a built artifact for later requests and workers, as the caller (signed with
        `signer` when given); a caller that may not (a reader, over quota) still gets its
        tokens."""
        try:
            client.put_artifact(cached, spec, to_bytes(compressed), signer=signer)
        except StoreError as error:
            log.info("artifact %s not stored for later requests: %s", spec, error)

    def _compress(self, pipeline, source: FullKVSource, observed) -> CompressedKV:
        c = self.model.config
        return pipeline.compress(source, observed, c.num_layers, c.num_kv_heads, c.head_dim)

    def _observe(self, prefix: Prefix, window: int) -> list[torch.Tensor]:
        """The rotated queries of the prefix's last `window` tokens: their exact forward
        over the rest of the prefix's full KV (what the prefill observed)."""
        p = prefix.source.length
        w = min(window, p)
        need = p * self.model.config.kv_bytes_per_token
        self.budget.reserve(need)  # transient
        try:
            cache = self.runner.new_cache(capacity=p)
            c = self.model.config
            k = torch.empty(c.num_kv_heads, p, c.head_dim)
            v = torch.empty(c.num_kv_heads, p, c.head_dim)
            for index, layer in enumerate(cache.layers):
                prefix.source.read_layer(index, k, v)
                layer.append(k[:, : p - w], v[:, : p - w], torch.arange(p - w))
            seq = SeqInput.extend(cache, prefix.tokens[p - w :], logits="none", observe=w)
            self.runner.forward([seq], "exact")
            return seq.observed
        finally:
            self.budget.release(need)
