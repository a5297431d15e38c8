"""The Decoder gRPC service: `Generate` (a stream of verified tokens, then stats),
`Publish` and `Info`, with health checking and reflection.

Every method takes its request as raw bytes and first authenticates the caller's token
against the store (`DecoderWorker.authenticate`): a caller without a known token gets
UNAUTHENTICATED whatever it sends, before any byte of its request is parsed or tokenized.
The deployment's internal credential (`decoder.internal`: what routers present) is
accepted for Info alone, never sent to the store: any other method is PERMISSION_DENIED.
Every failure ends the call with a precise status (`decoder.service.status`): a bad
request is INVALID_ARGUMENT, an unknown token UNAUTHENTICATED, a request larger than the
whole KV budget RESOURCE_EXHAUSTED, a prefix whose full KV can be neither read nor
recomputed or a decoder shutting down UNAVAILABLE, a stored artifact that is not one
DATA_LOSS; anything unexpected is INTERNAL with only a request id, logged with its traceback
under that id. Tokens sent before a failure were verified; nothing else is sent.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

from vericache.v1 import decoder_pb2 as dpb

from decoder.compressors import parse_compressor
from decoder.engine import ENGINE_MODES
from decoder.internal import (
    CALLER,
    INTERNAL,
    InternalCaller,
    check_method,
    read_credential,
)
from decoder.sampling import SamplingParams
from decoder.service.config import (
    MAX_NGRAM,
    MAX_STOP_CHARS,
    MAX_STOP_IDS,
    MAX_STOPS,
    DecoderConfig,
)
from decoder.service.endpoint import decoder_service
from decoder.service.status import STATUS, BadRequest
from decoder.service.worker import (
    DecoderWorker,
    GenerateSpec,
    Published,
    PublishSpec,
    WorkerInfo,
)
from prefix_store.client import StoreClient
from prefix_store.metrics import metrics_endpoint
from rpc.handler import Call, Gate, streaming, unary
from rpc.limits import CallLimits
from rpc.server import parse

log = logging.getLogger(__name__)
REQUESTS = {"Generate": dpb.GenerateRequest, "Publish": dpb.PublishRequest, "Info": dpb.InfoRequest}
"""The request message of each method."""


def event_message(event: tuple) -> dpb.GenerateEvent:
    if event[0] == "tokens":
        _, ids, text = event
        return dpb.GenerateEvent(tokens=dpb.Tokens(ids=ids, text=text))
    _, stop, stats = event
    return dpb.GenerateEvent(done=dpb.Done(stop_reason=stop, stats_json=stats))


# -- proto <-> spec: the worker takes and returns specs ---------------------------------------


def generate_spec(request: dpb.GenerateRequest, worker: DecoderWorker) -> GenerateSpec:
    """The request validated: every cheap field first, the prompt (tokenized) last."""
    config = worker.config
    mode = request.mode or "vericache"
    if mode not in ENGINE_MODES:
        raise BadRequest(f"mode {mode!r} is unknown; choose from: {', '.join(ENGINE_MODES)}")
    compressor = parse_compressor(request.compressor or config.default_compressor).spec
    if not 1 <= request.max_new_tokens <= config.max_new_tokens:
        raise BadRequest(
            f"max_new_tokens must be in [1, {config.max_new_tokens}], got {request.max_new_tokens}"
        )
    sampling = sampling_params(request.sampling)
    horizon = request.horizon if request.HasField("horizon") else None
    if horizon is not None and horizon > 256:
        raise BadRequest(f"horizon must be <= 256, got {horizon}")
    ngram = request.ngram if request.HasField("ngram") else config.ngram
    if ngram > MAX_NGRAM:
        raise BadRequest(f"ngram must be <= {MAX_NGRAM}, got {ngram}")
    prompt = prompt_ids(request, worker)
    if len(prompt) < 2:
        raise BadRequest("prompt: at least 2 tokens are needed (a prefix and one more)")
    limit = worker.model.config.max_position_embeddings
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
        list(prompt),
        request.namespace,
        mode,
        compressor,
        request.max_new_tokens,
        sampling,
        horizon,
        request.use_unsigned_prefix,
        ngram,
        stop_strings(request),
        stop_ids(request, worker.model.config.vocab_size),
    )


def stop_strings(request: dpb.GenerateRequest) -> tuple[str, ...]:
    if len(request.stop) > MAX_STOPS:
        raise BadRequest(f"stop: at most {MAX_STOPS} strings, got {len(request.stop)}")
    if any(not 1 <= len(s) <= MAX_STOP_CHARS for s in request.stop):
        raise BadRequest(f"stop: each string must be 1-{MAX_STOP_CHARS} characters")
    if any("\ufffd" in s for s in request.stop):  # the text's mark of an unfinished character
        raise BadRequest("stop: U+FFFD cannot be matched")
    return tuple(request.stop)


def stop_ids(request: dpb.GenerateRequest, vocab: int) -> frozenset[int]:
    count = len(request.stop_token_ids)
    if count > MAX_STOP_IDS:
        raise BadRequest(f"stop_token_ids: at most {MAX_STOP_IDS}, got {count}")
    bad = next((t for t in request.stop_token_ids if t >= vocab), None)
    if bad is not None:
        raise BadRequest(f"stop_token_ids: {bad} is outside the vocabulary [0, {vocab})")
    return frozenset(request.stop_token_ids)


def sampling_params(s: dpb.Sampling) -> SamplingParams:
    """The request's sampling; top_p 0 is proto3's unset (off). Anything outside a field's
    range (NaN included) is INVALID_ARGUMENT naming it, never quietly off."""
    try:
        return SamplingParams(
            s.temperature,
            s.top_k,
            s.top_p if s.top_p != 0 else 1.0,
            s.seed if s.HasField("seed") else None,
        )
    except ValueError as error:
        raise BadRequest(f"sampling: {error}") from None


def publish_spec(request: dpb.PublishRequest, worker: DecoderWorker) -> PublishSpec:
    tokens = prompt_ids(request, worker)
    if not tokens:
        raise BadRequest("prompt: the prefix is empty")
    compressors = [parse_compressor(spec).spec for spec in request.compressors]
    return PublishSpec(list(tokens), request.namespace, compressors)


def prompt_ids(request, worker: DecoderWorker) -> Sequence[int]:
    """The prompt's token ids; INVALID_ARGUMENT for one that cannot fit the model's context
    (text too long for it is refused before it is tokenized)."""
    which = request.WhichOneof("prompt")
    model = worker.model
    limit = model.config.max_position_embeddings
    if which == "text":
        if not request.text:
            raise BadRequest("prompt: the text is empty")
        if len(request.text) > limit * worker.max_token_chars:
            raise BadRequest(
                f"prompt: {len(request.text)} characters cannot fit the model's context "
                f"of {limit} tokens"
            )
        return _fits(model.encode(request.text, chat=request.chat), limit)
    if which == "token_ids":
        _fits(request.token_ids.ids, limit)  # its length, before any list is made
        ids = list(request.token_ids.ids)
        vocab = model.config.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise BadRequest(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        return ids
    raise BadRequest("prompt: set text or token_ids")


def _fits(ids: Sequence[int], limit: int) -> Sequence[int]:
    if len(ids) > limit:
        raise BadRequest(f"prompt: {len(ids)} tokens exceed the model's context of {limit}")
    return ids


def published_message(published: Published) -> dpb.PublishResponse:
    return dpb.PublishResponse(
        tokens=published.tokens,
        stored_bytes=published.stored_bytes,
        artifacts=published.artifacts,
        prefill_s=published.prefill_s,
    )


def info_message(info: WorkerInfo) -> dpb.InfoResponse:
    return dpb.InfoResponse(**dataclasses.asdict(info))


class DecoderServicer:
    """The Decoder's methods; each gets its parsed request and the call (`rpc.handler`),
    whose token was authenticated against the store before the request was parsed."""

    def __init__(self, worker: DecoderWorker) -> None:
        self.worker = worker
        self.limits = CallLimits(worker.config.calls)
        self.gate = Gate(
            "Decoder", worker.metrics.rpc, STATUS, self.authenticate, self.admit, self.read
        )
        path = worker.config.internal_token_file
        self.internal = read_credential(path) if path is not None else None
        """The deployment's internal credential (a router reading Info), if configured."""

    def authenticate(self, token: str, peer: str) -> AbstractContextManager:
        """The caller, held while its call runs: `INTERNAL` for the deployment's internal
        credential (never sent to the store), else the tenant's store client (the store's
        Unauthenticated for a token it does not know)."""
        if self.internal is not None and self.internal.matches(token):
            return nullcontext(INTERNAL)
        return self.worker.authenticate(token, peer)

    def admit(self, client: StoreClient | InternalCaller):
        """One of the caller's call slots (its tenant, weight and role, as the store named
        them): its fair share, or the admin pool; the internal caller's, the admin pool
        first."""
        if client is INTERNAL:
            return self.limits.admit(CALLER, admin=True)
        topology = client.topology
        return self.limits.admit(topology.tenant, topology.weight, topology.admin)

    def read(self, method: str, raw: bytes, call: Call):
        """`method`'s request, parsed once its caller is let in."""
        check_method(call.caller, method)
        return parse(REQUESTS[method], raw)

    @streaming
    def Generate(self, request, call: Call):
        spec = generate_spec(request, self.worker)
        events = self.worker.generate(call.token, spec, cancelled=lambda: not call.is_active())
        for event in events:
            yield event_message(event)

    @unary
    def Publish(self, request, call: Call):
        spec = publish_spec(request, self.worker)
        return published_message(self.worker.publish(call.token, spec))

    @unary
    def Info(self, request, call: Call):
        return info_message(self.worker.info())


class DecoderServer:
    """A decoder worker serving gRPC."""

    def __init__(self, config: DecoderConfig, worker: DecoderWorker | None = None) -> None:
        self.config = config
        self.worker = worker or DecoderWorker(config)
        self.server, self.port = decoder_service(
            DecoderServicer(self.worker), config.max_workers, config.host, config.port,
            config.tls, "dec",
        )  # fmt: skip
        self.address = f"{config.advertise_host or config.host}:{self.port}"
        self.metrics, self.metrics_url = metrics_endpoint(
            self.worker.metrics.registry, config.metrics, config.host, config.advertise_host,
            config.tls,
        )  # fmt: skip

    def start(self) -> str:
        if self.metrics is not None:
            self.metrics.start()
        self.server.start()
        log.info("decoder %s serving on %s", self.config.worker_id, self.address)
        return self.address

    def stop(self, grace_s: float = 5.0) -> None:
        self.server.stop(grace_s).wait()
        if self.metrics is not None:
            self.metrics.stop()
        self.worker.close()
