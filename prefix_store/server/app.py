"""The shard's gRPC server: the `vericache.v1.PrefixStore` service served by its parts
over one `Shard` (`handlers`), and `ShardServer`, which bundles the shard, its server (with
health checking and reflection, `rpc.server.grpc_server`), its data plane, metrics endpoint
and scrubber, and the membership heartbeat."""

from __future__ import annotations

import logging
import threading

import grpc

from prefix_store.config import ShardConfig
from prefix_store.data_plane import DataPlane
from prefix_store.metadata import Metadata
from prefix_store.metrics import metrics_endpoint
from prefix_store.scrub import Scrubber
from prefix_store.server.admin import Admin
from prefix_store.server.artifacts import Artifacts
from prefix_store.server.attend import AttendMethod
from prefix_store.server.chunks import Chunks
from prefix_store.server.service import Service
from prefix_store.shard import Shard
from prefix_store.tls import server_context
from rpc.handler import serialize
from rpc.server import grpc_server

log = logging.getLogger(__name__)
SERVICE = "vericache.v1.PrefixStore"
REQUEST_SLACK = 1 << 20
"""The transport accepts messages up to `max_message_bytes` plus this, so that one a little
over the limit gets INVALID_ARGUMENT naming it; beyond, gRPC answers RESOURCE_EXHAUSTED
before any handler runs."""
UNARY, CLIENT_STREAM = grpc.unary_unary_rpc_method_handler, grpc.stream_unary_rpc_method_handler
SERVER_STREAM, BIDI = grpc.unary_stream_rpc_method_handler, grpc.stream_stream_rpc_method_handler
METHODS = (
    (Admin, {"Describe": UNARY, "Stats": UNARY}),
    (Chunks, {"Lookup": UNARY, "Delete": UNARY, "OpenFetch": UNARY, "OpenPut": UNARY,
              "Put": CLIENT_STREAM, "Fetch": SERVER_STREAM}),
    (Artifacts, {"PutArtifact": CLIENT_STREAM, "FetchArtifact": SERVER_STREAM,
                 "OpenPutArtifact": UNARY, "OpenFetchArtifact": UNARY}),
    (AttendMethod, {"Attend": BIDI}),
)  # fmt: skip
"""Each part of the service and its methods, by the shape of their streams."""
SERIALISED = frozenset({"Fetch"})
"""Methods whose responses are built serialised (`protocol.wire`): sent as they are."""


def server_options(config: ShardConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        # gRPC has one receive limit for every method: the streams' messages (Put segment
        # batches, PutArtifact data) need `max_message_bytes`; a little more lets one over
        # it get INVALID_ARGUMENT naming the limit (`REQUEST_SLACK`). Unary requests are
        # bounded lower by their handlers before they are parsed (`request_limit`).
        ("grpc.max_receive_message_length", config.max_message_bytes + REQUEST_SLACK),
        ("grpc.http2.lookahead_bytes", 16 << 20),
        ("grpc.http2.bdp_probe", 1),
        ("grpc.so_reuseport", 0),
        # Clients ping every few seconds while calls are open, to find dead links fast.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def _same(raw: bytes) -> bytes:
    return raw


def handlers(service: Service) -> grpc.GenericRpcHandler:
    """The service's method table, as the generated `add_PrefixStoreServicer_to_server`
    builds it, except that requests (and Fetch responses) stay serialised bytes: each
    handler authenticates before it parses (`rpc.handler`)."""
    methods = {}
    for part_class, kinds in METHODS:
        part = part_class(service)
        for name, kind in kinds.items():
            response = _same if name in SERIALISED else serialize
            methods[name] = kind(
                getattr(part, name), request_deserializer=_same, response_serializer=response
            )
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def create_server(service: Service, config: ShardConfig) -> tuple[grpc.Server, int]:
    """A server with the store, health checking and reflection; binds `config.port`
    (0 = a free port; TLS when `config.tls`) and returns the port actually bound."""
    return grpc_server(
        handlers(service), SERVICE, f"{config.host}:{config.port}", config.tls,
        workers=config.workers, name="store", options=server_options(config),
    )  # fmt: skip


class ShardServer:
    """A shard serving gRPC and heartbeating its membership and usage into Redis."""

    def __init__(self, config: ShardConfig, redis_url: str) -> None:
        self.config = config
        self.metadata = Metadata(redis_url)
        self.shard = Shard(config)
        self.data_plane = None
        data_address = ""
        if config.data_port is not None:
            tls = server_context(config.tls) if config.tls is not None else None
            self.data_plane = DataPlane(config.host, config.data_port, config.data_limits, tls)
            data_address = f"{config.advertised}:{self.data_plane.port}"
        self.servicer = Service(self.shard, self.metadata, config, self.data_plane, data_address)
        """What the service's parts share (its call limits, kernel, figures)."""
        self.server, self.port = create_server(self.servicer, config)
        self.address = f"{config.advertised}:{self.port}"
        self.data_address = data_address
        self.metrics, self.metrics_url = metrics_endpoint(
            self.servicer.metrics.registry, config.metrics, config.host, config.advertised,
            config.tls,
        )  # fmt: skip
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        self.scrubber = Scrubber(self.shard, config.scrub_rate) if config.scrub_rate else None

    def start(self) -> str:
        self.server.start()
        if self.data_plane is not None:
            self.data_plane.start()
        if self.metrics is not None:
            self.metrics.start()
        self._heartbeat()
        self._beat.start()
        if self.scrubber is not None:
            self.scrubber.start()
        log.info("shard %s serving on %s", self.config.shard_id, self.address)
        return self.address

    def _heartbeat(self) -> None:
        info = {
            **self.servicer.shard_stats(),
            "data_address": self.data_address,
            "attention_kernel": self.servicer.kernel,
            "metrics_url": self.metrics_url,
        }
        self.metadata.heartbeat(
            self.config.shard_id, self.address, info, self.shard.usage(), self.config.ttl_s
        )

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            try:
                self._heartbeat()
            except Exception as error:  # noqa: BLE001 - keep beating until Redis is back
                log.warning("shard %s: heartbeat failed: %s", self.config.shard_id, error)

    def stop(self, grace_s: float | None = None) -> None:
        """Leave the membership, finish in-flight RPCs, persist memory to disk."""
        self._stop.set()
        try:
            self.metadata.deregister(self.config.shard_id)
        except Exception as error:  # noqa: BLE001
            log.warning("shard %s: deregister failed: %s", self.config.shard_id, error)
        if self.data_plane is not None:
            self.data_plane.stop()
        if self.metrics is not None:
            self.metrics.stop()
        if self.scrubber is not None:
            self.scrubber.stop()
        self.server.stop(self.config.grace_s if grace_s is None else grace_s).wait()
        self.shard.flush()
