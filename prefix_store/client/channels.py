"""The connections both client shells use: gRPC channels per shard and lane, the bulk
methods that move serialised messages untouched, the data plane's TLS context."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable

from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from prefix_store.client.transfer import abandon, receive_artifact, send_artifact, send_put
from prefix_store.config import ClientConfig
from prefix_store.protocol.frames import redemption
from prefix_store.tls import client_context

PUT_METHOD = "/vericache.v1.PrefixStore/Put"
"""Put taking serialised requests (built by `plan.put_messages`)."""
FETCH_METHOD = "/vericache.v1.PrefixStore/Fetch"
"""Fetch returning serialised responses (parsed by `Assembly.apply`)."""


def same(raw: bytes) -> bytes:
    return raw


def channel_options(config: ClientConfig) -> list[tuple[str, int]]:
    # A channel to a failed shard redials at least every quarantine_s / 2 (gRPC's default
    # backoff grows to 120 s): when the quarantine ends, the shard is dialled again.
    redial_ms = max(100, int(config.quarantine_s * 500))
    return [
        ("grpc.initial_reconnect_backoff_ms", min(1000, redial_ms)),
        ("grpc.max_reconnect_backoff_ms", redial_ms),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.http2.lookahead_bytes", config.window_bytes),
        ("grpc.http2.bdp_probe", 1),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.enable_retries", 0),
        # A peer that stops answering is found within ~idle_timeout_s, not at the deadline.
        ("grpc.keepalive_time_ms", int(config.idle_timeout_s * 500)),
        ("grpc.keepalive_timeout_ms", int(config.idle_timeout_s * 500)),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def data_plane_tls(config: ClientConfig) -> ssl.SSLContext | None:
    """The data plane's TLS context for `config.tls` (built once per client); None: plain."""
    return client_context(config.tls) if config.tls is not None else None


class Connections:
    """A client's gRPC channels to the shards, one per (address, lane) (lanes are separate
    connections), with its credentials and data-plane TLS context. `make` builds a channel
    (`tls.make_channel`, or `tls.make_aio_channel` for asyncio). Thread-safe."""

    def __init__(self, config: ClientConfig, token: str, make: Callable) -> None:
        self.config = config
        self.token = token
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.data_tls = data_plane_tls(config)
        self._make = make
        self._channels: dict[tuple[str, int], object] = {}
        self._lock = threading.Lock()

    def channel(self, address: str, lane: int = 0):
        with self._lock:
            channel = self._channels.get((address, lane))
            if channel is None:
                channel = self._make(address, channel_options(self.config), self.config.tls)
                self._channels[(address, lane)] = channel
        return channel

    def stub(self, address: str, lane: int = 0) -> pb_grpc.PrefixStoreStub:
        return pb_grpc.PrefixStoreStub(self.channel(address, lane))

    def call(self, address: str, method: str, request, timeout_s: float):
        """A unary or streaming call on the shard at `address` (awaitable on asyncio)."""
        return getattr(self.stub(address), method)(
            request, metadata=self.metadata, timeout=timeout_s
        )

    def bulk_put(self, address: str, lane: int):
        """Put taking serialised requests (built by `plan.put_messages`)."""
        return self.channel(address, lane).stream_unary(
            PUT_METHOD, request_serializer=same, response_deserializer=pb.PutResponse.FromString
        )

    def bulk_fetch(self, address: str, lane: int):
        """Fetch returning serialised responses (parsed by `Assembly.apply`)."""
        return self.channel(address, lane).unary_stream(
            FETCH_METHOD,
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=same,
        )

    def send_put(self, publish, stream, ticket: bytes, timeout_s: float) -> pb.PutResponse:
        """A put's data-plane transfer, after OpenPut granted `ticket` (blocking)."""
        return send_put(
            stream.data_address,
            redemption(ticket, self.token),
            publish.layout,
            stream.chunks,
            publish.layers,
            timeout_s,
            self.data_tls,
        )

    def send_artifact(self, address: str, ticket: bytes, data, timeout_s: float) -> int:
        """An artifact's data-plane put at `address`, after OpenPutArtifact granted `ticket`
        (blocking); the bytes stored."""
        redeem = redemption(ticket, self.token)
        return send_artifact(address, redeem, data, timeout_s, self.data_tls).stored_bytes

    def receive_artifact(self, address: str, ticket: pb.TransferTicket, timeout_s: float):
        """An artifact's bytes over the data plane, after OpenFetchArtifact (blocking)."""
        redeem = redemption(ticket.ticket, self.token)
        size = ticket.total_bytes
        return receive_artifact(address, redeem, size, timeout_s, self.data_tls)

    def abandon(self, address: str, ticket: bytes) -> None:
        """Give a ticket back at once (see `transfer.abandon`; blocking)."""
        abandon(address, redemption(ticket, self.token), self.config.idle_timeout_s, self.data_tls)

    def take(self) -> list:
        """Every channel, forgotten (the caller closes them)."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        return channels
