"""The router's gRPC server: the `Decoder` service in front of the deployment's decoders.

Every method authenticates the caller's token against the store first (as a decoder
does: an unknown token is UNAUTHENTICATED before any byte of the request is parsed), takes
one of the caller's call slots, and forwards the call with the caller's own credentials,
so decoders see, authorize and account for the caller exactly as if it had called them.

- Generate goes to the decoder the routing policy (`policies`) chooses from its prefix
  identity (`identity`) and the decoders' loads, and moves to another one if that
  decoder fails (`relay.Relay`). A sampled request without a seed is given one here first.
- Publish goes to the decoder that requests over the published prefix will go to (so
  the compressed copy it builds is where they need it), on another one if it is down.
- Info sums what the live decoders report (`worker_id` is the router's).
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Counter
from vericache.v1 import decoder_pb2 as dpb

from decoder.http.app import Upstream
from decoder.http.config import HttpConfig
from decoder.http.openai import Model, control_tokens
from decoder.http.server import HttpServer
from decoder.router.config import RouterConfig
from decoder.router.identity import request_identity
from decoder.router.members import Members, least
from decoder.router.policies import make_policy
from decoder.router.relay import Diverged, Forwarded, Relay
from decoder.service.clients import StoreClients
from decoder.service.endpoint import decoder_service
from decoder.service.status import STATUS as DECODER_STATUS
from prefix_store.metrics import metrics_endpoint
from prefix_store.status import busy_retry_s
from rpc.handler import Call, Gate, as_sent, streaming, unary
from rpc.limits import CallLimits
from rpc.metrics import RpcMetrics
from rpc.server import parse
from rpc.status import StatusMap

log = logging.getLogger(__name__)
SERVICE = "vericache.v1.Decoder"
SUMMED = ("kv_budget", "kv_used", "in_flight", "queued", "kv_cached", "cached_prefixes",
          "engines", "weight_bytes", "peak_rss_bytes")  # fmt: skip
"""Info fields the router reports as the sum over its live decoders."""


class RouterStatus(StatusMap):
    """The decoders' statuses, a decoder's own failure relayed as it came (`Forwarded`),
    and DATA_LOSS for a stream that diverged on failover (logged: it should never be)."""

    def abort(self, context, error: BaseException, where: str):
        if isinstance(error, Diverged):
            log.error("router: %s", error)
        super().abort(context, error, where)


STATUS = RouterStatus({Diverged: grpc.StatusCode.DATA_LOSS}, below=DECODER_STATUS, logger=log)


class RouterServicer:
    def __init__(self, config: RouterConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.members = Members(config)
        self.clients = StoreClients(
            config.store_endpoints, config.client, config.store_clients, config.auth_recheck_s
        )
        self.limits = CallLimits(config.calls)
        self.policy = make_policy(config)
        self.registry = CollectorRegistry()
        self.rpc = RpcMetrics(self.registry, "router")
        self.gate = Gate("Router", self.rpc, STATUS, self.clients.held, self.admit, as_sent)
        self.failovers = Counter(
            "vericache_router_failovers_total",
            "Requests moved to another decoder after theirs failed (mid-stream included).",
            registry=self.registry,
        )

    def admit(self, client):
        """One of the caller's call slots: its tenant's fair share (weighted), or the admin
        pool, as the store named them."""
        topology = client.topology
        return self.limits.admit(topology.tenant, topology.weight, topology.admin)

    def close(self) -> None:
        self.members.close()
        self.clients.close()

    @streaming
    def Generate(self, raw, call: Call):
        request = parse(dpb.GenerateRequest, raw)
        if request.sampling.temperature > 0 and not request.sampling.HasField("seed"):
            request.sampling.seed = secrets.randbits(64)  # every attempt samples alike
            raw = request.SerializeToString()
        relay = Relay(
            self.members,
            self._order(self._identity(call.caller, request)),
            raw,
            _forwarded(call),
            self.config.max_attempts,
            self.failovers.inc,
            stop_strings=bool(request.stop),
        )
        yield from relay.events()

    @unary
    def Publish(self, raw, call: Call):
        request = parse(dpb.PublishRequest, raw)
        identity = self._identity(call.caller, request)
        return self._unary("Publish", identity, raw, call, dpb.PublishResponse)

    @unary
    def Info(self, raw, call: Call):
        parse(dpb.InfoRequest, raw)
        total = dpb.InfoResponse(worker_id=self.config.router_id)
        for endpoint in self.members.loads():
            try:
                info = self._call(endpoint, "Info", raw, call, dpb.InfoResponse)
            except grpc.RpcError:
                continue  # a decoder going down: the others still answer
            total.model_id = total.model_id or info.model_id
            total.default_compressor = total.default_compressor or info.default_compressor
            for name in SUMMED:
                setattr(total, name, getattr(total, name) + getattr(info, name))
            total.max_new_tokens = least(total.max_new_tokens, info.max_new_tokens)
        return total

    def _order(self, identity: int):
        """The request's decoders, best first, as the policy ranks them (asked again before
        each attempt: the live set and loads change)."""
        ranking = self.policy.ranking(identity)
        return lambda: ranking(self.members.loads())

    def _identity(self, client, request) -> int:
        """The request's prefix identity, in the namespace it names."""
        salts = client.topology.salts
        return request_identity(request, salts, self.tokenizer, self.config.affinity_chunks)

    def _unary(self, method: str, identity: int, raw: bytes, context, response):
        """A unary call on the request's decoder, or the next one when it is unreachable or
        refuses it as busy (`retry-after-ms`); when every decoder tried was busy, the
        caller is told so (RESOURCE_EXHAUSTED with `retry-after-ms`), not UNAVAILABLE."""
        busy: Forwarded | None = None
        for endpoint in self._order(identity)()[: self.config.max_attempts]:
            try:
                return self._call(endpoint, method, raw, context, response)
            except grpc.RpcError as error:
                failure = Forwarded(error.code(), error.details() or "", error.trailing_metadata())
                if busy_retry_s(error) is not None:
                    busy = failure
                    continue
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise failure from None
                self.members.failed(endpoint)
        if busy is not None:
            raise busy
        raise Forwarded(grpc.StatusCode.UNAVAILABLE, "no decoder could serve the request")

    def _call(self, endpoint: str, method: str, raw: bytes, context, response):
        call = self.members.channel(endpoint).unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=lambda r: r,
            response_deserializer=response.FromString,
        )
        with self.members.holding(endpoint):
            return call(raw, metadata=_forwarded(context), timeout=context.time_remaining())

    def set_decoders(self, decoders: Iterable[str]) -> None:
        self.members.set(decoders)


def _forwarded(context) -> tuple:
    """The caller's credentials, passed on as they came."""
    return tuple((k, v) for k, v in context.invocation_metadata() if k == "authorization")


class RouterServer:
    """A router serving gRPC (and its metrics, and the OpenAI-compatible HTTP API, when
    configured)."""

    def __init__(self, config: RouterConfig, tokenizer=None) -> None:
        self.config = config
        self.servicer = RouterServicer(config, tokenizer or load_tokenizer(config.model))
        self.server, self.port = decoder_service(
            self.servicer, config.max_workers, config.host, config.port, config.tls, "route"
        )
        self.address = f"{config.advertise_host or config.host}:{self.port}"
        self.http = None if config.http is None else self._http(config.http)
        self.http_url = "" if self.http is None else (
            f"{self.http.scheme}://{config.advertise_host or config.http.host}:{self.http.port}"
        )  # fmt: skip
        self.metrics, self.metrics_url = metrics_endpoint(
            self.servicer.registry, config.metrics, config.host, config.advertise_host,
            config.tls,
        )  # fmt: skip

    def _http(self, config: HttpConfig) -> HttpServer:
        """The HTTP API, forwarding to this router's own Decoder service over a Unix socket
        in a directory only this process's user may enter (TLS is for the network)."""
        self._socket_dir = tempfile.mkdtemp(prefix="vericache-router-")
        target = f"unix:{self._socket_dir}/grpc.sock"
        if not self.server.add_insecure_port(target):
            raise OSError(f"cannot bind {target}")
        clients = self.servicer.clients

        def authenticate(token: str, peer: str) -> None:
            with clients.held(token, peer):
                pass

        model = served_model(self.config.model, self.servicer.tokenizer, config.model_name)
        upstream = Upstream(target, authenticate, self.servicer.members.max_new_tokens)
        return HttpServer(config, model, upstream, self.servicer.registry, self.config.tls)

    def start(self) -> str:
        if self.metrics is not None:
            self.metrics.start()
        self.server.start()
        if self.http is not None:
            self.http.start()
            log.info("router %s serving HTTP on %s", self.config.router_id, self.http_url)
        log.info("router %s serving on %s", self.config.router_id, self.address)
        return self.address

    def set_decoders(self, decoders: Iterable[str]) -> None:
        """The live decoder set is now `decoders` (host:port each)."""
        self.servicer.set_decoders(decoders)

    def decoders(self) -> list[dict]:
        return self.servicer.members.snapshot()

    def stop(self, grace_s: float = 5.0) -> None:
        if self.http is not None:
            self.http.stop()
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        self.server.stop(grace_s).wait()
        if self.metrics is not None:
            self.metrics.stop()
        self.servicer.close()


def load_tokenizer(model: str | None):
    """The decoders' tokenizer alone (no weights): routing text prompts needs only it."""
    from decoder.tokenizer import load_tokenizer

    return load_tokenizer(model_folder(model))


def model_folder(model: str | None) -> Path:
    """The decoders' model folder (None: the built-in model's)."""
    from decoder.loader import builtin_model_dir, default_cache_dir

    return builtin_model_dir(default_cache_dir()) if model is None else Path(model)


def served_model(model: str | None, tokenizer, name: str | None = None) -> Model:
    """What the HTTP API tells and checks of the decoders' model: its id (`name`, else the
    built-in model's name or the folder's), context and tokenizer."""
    from decoder.config import context_limit
    from decoder.loader import BUILTIN_MODEL

    folder = model_folder(model)
    hf = json.loads((folder / "config.json").read_text())
    name = name or (BUILTIN_MODEL if model is None else folder.name)
    return Model(name, context_limit(hf), tokenizer, control_tokens(tokenizer))
