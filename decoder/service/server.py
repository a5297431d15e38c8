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

import logging
from contextlib import AbstractContextManager, nullcontext

import grpc
from vericache.v1 import decoder_pb2 as dpb

from decoder.internal import (
    CALLER,
    INTERNAL,
    InternalCaller,
    check_method,
    read_credential,
)
from decoder.service.config import DecoderConfig
from decoder.service.status import STATUS
from decoder.service.worker import DecoderWorker
from prefix_store.client import StoreClient
from prefix_store.metrics import metrics_endpoint
from rpc.handler import Call, Gate, serialize, streaming, unary
from rpc.limits import CallLimits
from rpc.server import grpc_server, parse

log = logging.getLogger(__name__)
SERVICE = "vericache.v1.Decoder"
REQUESTS = {"Generate": dpb.GenerateRequest, "Publish": dpb.PublishRequest, "Info": dpb.InfoRequest}
"""The request message of each method."""


def event_message(event: tuple) -> dpb.GenerateEvent:
    if event[0] == "tokens":
        _, ids, text = event
        return dpb.GenerateEvent(tokens=dpb.Tokens(ids=ids, text=text))
    _, stop, stats = event
    return dpb.GenerateEvent(done=dpb.Done(stop_reason=stop, stats_json=stats))


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
        spec = self.worker.parse_generate(request)
        events = self.worker.generate(call.token, spec, cancelled=lambda: not call.is_active())
        for event in events:
            yield event_message(event)

    @unary
    def Publish(self, request, call: Call):
        return self.worker.publish(call.token, request)

    @unary
    def Info(self, request, call: Call):
        return self.worker.info()


def handlers(servicer: DecoderServicer) -> grpc.GenericRpcHandler:
    """The service's method table, as the generated `add_DecoderServicer_to_server` builds
    it, except that requests stay bytes: each handler authenticates before it parses."""
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                servicer.Generate, response_serializer=serialize
            ),
            "Publish": grpc.unary_unary_rpc_method_handler(
                servicer.Publish, response_serializer=serialize
            ),
            "Info": grpc.unary_unary_rpc_method_handler(
                servicer.Info, response_serializer=serialize
            ),
        },
    )


def decoder_service(servicer, workers: int, host: str, port: int, tls, name: str):
    """A gRPC server serving the Decoder service with `servicer` (a decoder's or a
    router's: the same methods), health checking and reflection, bound to host:port (TLS
    when `tls`); (server, the port bound)."""
    options = [("grpc.max_receive_message_length", 64 << 20)]
    return grpc_server(
        handlers(servicer), SERVICE, f"{host}:{port}", tls, workers=workers, name=name,
        options=options,
    )  # fmt: skip


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
