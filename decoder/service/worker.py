"""A decoder worker: the request flow of DESIGN.md section 4 over the prefix store.

Generate:
1. the longest cached prefix of the prompt is looked up with the caller's token (so a
   tenant finds exactly what it may read); its compressed artifact for the requested spec
   is fetched once per worker when the request's group first drafts over it (a group held
   as full KV holds it may never), or, when missing, built here once from the full KV and
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
bounded by its own limit: prefixes and their artifacts in the `PrefixCache`
(prefix_cache.py), engines in the `EnginePool` (engine_pool.py). All model work runs on the
`ModelThread` (model_thread.py); the model work on a prefix is `decoder.engine.prefix_work`.
The worker takes and returns specs; the service's server converts them from and to protobufs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import resource
import time
import uuid
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

from decoder.budget import KVBudget
from decoder.compressors import parse_compressor
from decoder.compressors.artifact import to_bytes
from decoder.config import RunnerConfig
from decoder.engine import Request
from decoder.engine.prefix_work import compress, prefill_bytes, prefill_prefix, read_full_kv
from decoder.loader import LoadedModel, load_runner
from decoder.runner import ModelRunner
from decoder.sampling import SamplingParams
from decoder.service.audit import Auditor, Sample
from decoder.service.clients import StoreClients
from decoder.service.config import DecoderConfig
from decoder.service.engine_pool import EnginePool
from decoder.service.metrics import DecoderMetrics
from decoder.service.model_thread import ModelThread
from decoder.service.prefix_cache import PrefixCache
from decoder.store_source import kv_layout
from prefix_store.client import StoreClient
from prefix_store.provenance import Signer, read_key

log = logging.getLogger(__name__)
_DONE = object()


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
    stops: tuple[str, ...] = ()
    """Stop strings: the request ends once its output's text contains one."""
    stop_ids: frozenset[int] = frozenset()
    """Stop token ids: the request ends with the first one generated."""


@dataclass(frozen=True)
class PublishSpec:
    """A validated Publish request."""

    tokens: list[int]
    namespace: str
    compressors: list[str]
    """Compressor specs to build and store an artifact for (validated)."""


@dataclass(frozen=True)
class Published:
    """What Publish stored."""

    tokens: int
    stored_bytes: int
    artifacts: list[str]
    """Canonical specs of the artifacts stored."""
    prefill_s: float


@dataclass(frozen=True)
class WorkerInfo:
    """The worker's figures (Info, and the metrics' gauges)."""

    model_id: str
    worker_id: str
    kv_budget: int
    kv_used: int
    in_flight: int
    queued: int
    default_compressor: str
    kv_cached: int
    cached_prefixes: int
    engines: int
    weight_bytes: int
    peak_rss_bytes: int
    max_new_tokens: int
    """The most new tokens a request may ask for (`DecoderConfig.max_new_tokens`)."""


class DecoderWorker:
    def __init__(self, config: DecoderConfig, model: LoadedModel | None = None) -> None:
        """model: an already loaded model to serve (default: load `config.model`)."""
        self.config = config
        rc = RunnerConfig(threads=config.threads)
        if model is None:  # its own: loaded into the runner layer by layer, held once
            self.model, self.runner = load_runner(config.model, rc, draft=True)
        else:  # a caller's, shared with others (tests): they hold the weights anyway
            self.model, self.runner = model, ModelRunner(model.config, model.weights, rc)
            self.runner.prepare_fast()  # as load_runner(draft=True) does: not in a request
        self.runner.ensure_exact_supported()
        self.layout = kv_layout(self.model.config, self.model.fingerprint)
        self.signer = self._signer(config)
        self.max_token_chars = max(map(len, self.model.tokenizer.get_vocab()))
        """The longest token's text: a text longer than this times the context cannot fit."""
        self.budget = KVBudget(config.kv_budget)
        self.model_thread = ModelThread()
        self.engines = EnginePool(
            self.runner, frozenset(self.model.eos_token_ids), self.budget, self.model_thread, config
        )
        self.prefixes = PrefixCache(
            self.runner,
            self.layout,
            self.budget,
            self.model_thread,
            self.signer,
            config.prefix_cache,
            config.worker_id,
        )
        self._clients = StoreClients(
            config.store_endpoints,
            config.client,
            config.store_clients,
            config.auth_recheck_s,
            self.prefixes.clients_in_use,
        )
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
        self.model_thread.stop()
        self._clients.close()

    # -- Info -----------------------------------------------------------------------------

    def info(self) -> WorkerInfo:
        pool, cache = self.engines.figures(), self.prefixes.figures()
        return WorkerInfo(
            model_id=self.layout.model_id,
            worker_id=self.config.worker_id,
            kv_budget=self.budget.limit or 0,
            kv_used=self.budget.used,
            in_flight=pool.in_flight,
            queued=pool.queued,
            default_compressor=self.config.default_compressor,
            kv_cached=cache.idle_bytes,
            cached_prefixes=cache.prefixes,
            engines=pool.engines,
            weight_bytes=self.runner.weight_bytes,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            max_new_tokens=self.config.max_new_tokens,
        )

    # -- Generate ---------------------------------------------------------------------------

    def generate(
        self, token: str, spec: GenerateSpec, cancelled=lambda: False, observed: bool = True
    ) -> Iterator:
        """Yield (token ids, text) as tokens are verified, then the final (stop, stats).
        `observed`: count the request in the metrics and offer it to the audit (False for
        the audit's own replays)."""
        request_id = uuid.uuid4().hex[:12]
        client = self.client(token)
        prompt = spec.prompt[:-1]
        held = self.prefixes.held(
            client, prompt, spec.namespace, spec.use_unsigned_prefix, cancelled
        )
        with held as entry:
            artifacts = None if spec.mode == "full" else self.prefixes.artifacts(entry, client)
            suffix = spec.prompt[entry.prefix.source.length :]
            with self.engines.engine(spec.mode, spec.compressor, spec.ngram) as engine:
                events: queue.Queue = queue.Queue()
                request = Request(
                    entry.prefix,
                    suffix,
                    spec.max_new_tokens,
                    spec.sampling,
                    spec.horizon,
                    stop_ids=spec.stop_ids,
                    prepaid=entry.prepaid,
                    artifacts=artifacts,
                )
                tenant = client.topology.tenant  # admission is fair between tenants
                ticket = self.model_thread.submit(engine, request, events.put, tenant)
                entry.prepaid = 0  # the ticket holds it now
                ticket.on_done = lambda: events.put(_DONE)
                cached = entry.cached.tokens if entry.cached is not None else 0
                extra = {"cached_tokens": cached, "request_id": request_id}
                done = (lambda *a: self._finished(token, tenant, spec, *a)) if observed else None
                yield from self._stream(ticket, events, cancelled, extra, done, spec.stops)

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
        if result.stop_reason == "stop":  # where a stop string ended it depends on timing:
            spec = dataclasses.replace(spec, stops=(), max_new_tokens=len(result.tokens))
        self.auditor.offer(Sample(stats["request_id"], token, spec, tuple(result.tokens)))

    def _replay(self, sample: Sample) -> list[int]:
        """The audit's reference: the sample decoded in full mode, as its caller could."""
        spec = dataclasses.replace(sample.spec, mode="full", ngram=0, horizon=None)
        tokens: list[int] = []
        for event in self.generate(sample.token, spec, observed=False):
            if event[0] == "tokens":
                tokens.extend(event[1])
        return tokens

    def _stream(
        self, ticket, events: queue.Queue, cancelled, extra: dict, done=None, stops=()
    ) -> Iterator:
        try:
            yield from self._events(ticket, events, cancelled, stops)
        finally:
            if not ticket.done:  # the caller went away: stop decoding for it
                ticket.cancel()
                self.model_thread.notify()
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

    def _events(self, ticket, events: queue.Queue, cancelled, stops=()) -> Iterator:
        """The request's token events, until it ends; once its text contains one of `stops`,
        the engine is asked to end it, and tokens after that one are not sent."""
        out: list[int] = []
        sent = ""
        stopped = False
        while True:
            try:
                item = events.get(timeout=0.25)
            except queue.Empty:
                if cancelled() or (ticket.done and events.empty()):
                    return  # (the second: it ended before on_done was attached)
                continue
            if item is _DONE:
                return
            if stopped:
                continue
            out.extend(item)
            text = self.model.decode(out)
            if text.endswith("\ufffd"):  # an incomplete character: wait for the rest
                piece = ""
            else:
                piece, sent = text[len(sent) :], text
            if stops and piece and _has_stop(text, len(text) - len(piece), stops):
                stopped = True
                ticket.stop()
                self.model_thread.notify()
            yield ("tokens", item, piece)

    # -- Publish ----------------------------------------------------------------------------

    def publish(self, token: str, spec: PublishSpec) -> Published:
        """Prefill the prefix once, store its full KV chunks (signed) and one artifact per
        requested compressor, as the caller."""
        pipelines = [parse_compressor(c) for c in spec.compressors]
        client = self.client(token)
        observe = max([p.observe_window for p in pipelines] + [1])

        def work() -> Published:  # on the model thread
            t0 = time.perf_counter()
            need = prefill_bytes(self.model.config, len(spec.tokens))
            self.budget.reserve(need)  # transient: the prefill's full KV
            try:
                prefix = prefill_prefix(self.runner, spec.tokens, observe)
                prefill_s = time.perf_counter() - t0
                kv = read_full_kv(prefix.source, self.model.config)
                result = client.publish_prefix(
                    spec.tokens, kv, self.layout, spec.namespace, signer=self.signer
                )
                del kv
                for pipeline in pipelines:
                    data = to_bytes(compress(pipeline, prefix, self.model.config))
                    client.put_artifact(result.prefix, pipeline.spec, data, signer=self.signer)
            finally:
                self.budget.release(need)
            specs = [p.spec for p in pipelines]
            return Published(result.prefix.tokens, result.stored_bytes, specs, prefill_s)

        return self.model_thread.call(work)

    # -- callers ----------------------------------------------------------------------------

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


def _has_stop(text: str, start: int, stops: tuple[str, ...]) -> bool:
    """Whether a stop string ends in `text` at or after `start` (the new piece)."""
    longest = max(len(s) for s in stops)
    tail = text[max(0, start - longest + 1) :]
    return any(s in tail for s in stops)
