"""The client side of the shard's bulk data plane (see prefix_store/data_plane.py): redeem
a ticket and receive every frame straight into the caller's tensors.

With TLS (an `ssl` client context, `prefix_store.tls.client_context`) the connection is a
TLS session that verifies the shard's certificate against the CA and checks that it names
the host of the data address dialled; a failed handshake is Unavailable like any socket
failure (the transfer fails over to a replica)."""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Sequence

import grpc
from google.protobuf.message import DecodeError
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.blob import crc32c
from prefix_store.client.arriving import nbytes, pieces
from prefix_store.client.plan import Assembly, ChunkPlan, chunk_crcs, wire_views
from prefix_store.errors import CorruptInTransit, LimitExceeded, StoreError, Unavailable
from prefix_store.layout import KVLayout
from prefix_store.protocol.frames import (
    CHECKED,
    COMMIT,
    DONE,
    ERROR,
    HEADER,
    OK,
    read_error,
    read_frame_header,
    recv_exact,
    send_buffers,
    tune,
)
from prefix_store.status import error_of


def in_band_error(
    sock: socket.socket, size: int, retry_after_ms: int = 0, fetch: bool = False
) -> StoreError:
    """The typed error of an in-band error frame. A refusal marked busy is `LimitExceeded`
    (the plane's bounds: a fetch tries a replica or waits, see `client.retry.busy_wait_s`; a
    put waits and tries again, see `retry.Attempts`), never `QuotaExceeded`. On a fetch
    every RESOURCE_EXHAUSTED is such a refusal (shards before the mark sent none)."""
    error = read_error(sock, size, retry_after_ms)
    busy = error.retry_after_ms is not None or fetch
    if error.code == "RESOURCE_EXHAUSTED" and busy:
        return LimitExceeded(f"data plane: {error.message}")
    status = getattr(grpc.StatusCode, error.code, grpc.StatusCode.UNAVAILABLE)
    return error_of(status, f"data plane: {error.message}")


class Cancel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def cancel(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class Cancels:
    """The streams of one fetch (gRPC calls, data-plane sockets: anything with a `cancel()`);
    one registered after `cancel_all` is cut at once. Thread-safe."""

    def __init__(self) -> None:
        self._items: list = []
        self._lock = threading.Lock()
        self.cancelled = False

    def track(self, item) -> None:
        with self._lock:
            self._items.append(item)
            if self.cancelled:
                item.cancel()

    def cancel_all(self) -> None:
        with self._lock:
            self.cancelled = True
            for item in self._items:
                item.cancel()


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def connect(address: str, timeout_s: float, tls: ssl.SSLContext | None) -> socket.socket:
    """A tuned connection to the data plane at `address`: a TLS session verifying the
    shard's certificate for the address's host when `tls` is given (handshake done)."""
    host, port = host_port(address)
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        tune(sock)
        return tls.wrap_socket(sock, server_hostname=host) if tls is not None else sock
    except BaseException:
        sock.close()
        raise


def receive(
    address: str,
    ticket: bytes,
    assembly: Assembly,
    chunks: Sequence[ChunkPlan],
    layer_from: int,
    timeout_s: float,
    track: Callable[[object], None] | None = None,
    tls: ssl.SSLContext | None = None,
) -> None:
    """Redeem `ticket` (a `redemption`) at `address` and write layers [layer_from, end) of
    `chunks` into the assembly, each layer checked against the CRC-32C stored with it.
    Socket failures raise Unavailable; an in-band error raises DataLoss (corrupt on the
    shard) or NotFound; bytes corrupted in transit raise CorruptInTransit (a DataLoss).
    `track` receives an object whose `cancel()` cuts the connection, so that nothing is
    written into the outputs after a cancel. `tls`: see `connect`."""
    layout = assembly.prefix.layout
    layers = assembly.layer_end - layer_from
    expected = sum(layout.segment_bytes(c.tokens) for c in chunks)
    try:
        with connect(address, timeout_s, tls) as sock:
            if track is not None:
                track(Cancel(sock))
            sock.sendall(ticket)
            for step in range(layers):
                if assembly.stopped:
                    return
                magic, layer, count, size = read_frame_header(sock)
                if magic == ERROR:
                    raise in_band_error(sock, size, layer, fetch=True)
                want = (CHECKED, layer_from + step, len(chunks), expected)
                if (magic, layer, count, size) != want:
                    raise Unavailable(
                        f"data plane: frame {(magic, layer, count, size)} from {address}, "
                        f"expected {want}"
                    )
                crcs = bytearray(4 * count)
                recv_exact(sock, memoryview(crcs))
                got = [0] * count
                for region, pieces in assembly.layer_regions(chunks, layer):
                    recv_exact(sock, region)
                    for position, piece in pieces:  # while the region is hot
                        got[position] = crc32c(piece, got[position])
                assembly.check_layer(chunks, layer, got, struct.unpack(f"<{count}I", crcs))
                assembly.mark_layer(chunks, layer, size)
    except OSError as error:
        raise Unavailable(f"data plane {address}: {error}") from error


def send_put(
    address: str,
    ticket: bytes,
    layout: KVLayout,
    chunks: Sequence[ChunkPlan],
    layers,
    timeout_s: float,
    tls: ssl.SSLContext | None = None,
) -> pb.PutResponse:
    """Redeem an OpenPut ticket: every layer of `chunks` from the tensors (no copies without
    TLS), the commit with each chunk's CRC-32C, then the shard's PutResponse or its typed
    error. `tls`: see `connect`."""
    crcs = [0] * len(chunks)
    layer_bytes = sum(layout.segment_bytes(c.tokens) for c in chunks)
    try:
        with connect(address, timeout_s, tls) as sock:
            with refused_while_sending(sock, address, len(chunks)):
                sock.sendall(ticket)
                for layer, (k, v) in enumerate(layers):
                    crcs = chunk_crcs([(k, v)], chunks, crcs)  # the layer is then hot to send
                    sock.sendall(HEADER.pack(OK, layer, len(chunks), layer_bytes))
                    send_buffers(sock, wire_views(k, v, chunks))
                commit = struct.pack(f"<{len(crcs)}I", *crcs)
                sock.sendall(HEADER.pack(COMMIT, 0, len(chunks), len(commit)) + commit)
            return put_reply(sock, address, len(chunks))
    except OSError as error:
        raise Unavailable(f"data plane {address}: {error}") from error


@contextlib.contextmanager
def refused_while_sending(sock: socket.socket, address: str, chunks: int):
    """A put's sending: if the shard cut it (it refused the put, answered in band, then
    closed with the rest unread), its answer rather than the broken pipe, when it is there
    to read within a moment; the send's OSError otherwise."""
    try:
        yield
    except OSError as sending:
        try:
            sock.settimeout(REFUSAL_READ_S)
            put_reply(sock, address, chunks)
        except StoreError as refusal:
            raise refusal from sending
        except OSError:
            raise sending from None
        raise sending


REFUSAL_READ_S = 0.5
"""How long a put whose sending failed looks for the shard's in-band answer."""


def put_reply(sock: socket.socket, address: str, chunks: int) -> pb.PutResponse:
    """The shard's answer to a data-plane put of `chunks` chunks: its PutResponse, or its
    typed error."""
    magic, hint, _, size = read_frame_header(sock)
    if magic == ERROR:
        raise in_band_error(sock, size, hint)
    if magic != DONE or size > 64 + 32 * chunks:  # two keys per chunk at most
        raise Unavailable(f"data plane: unexpected reply from {address} ({size} bytes)")
    body = bytearray(size)
    recv_exact(sock, memoryview(body))
    try:
        return pb.PutResponse.FromString(bytes(body))
    except DecodeError as error:
        raise Unavailable(f"data plane: malformed reply from {address}") from error


ARTIFACT_PIECE = 1 << 20
"""Artifacts are sent and received, and their CRC-32C computed, this many bytes at a time
(each piece checked while it is in cache)."""


def send_artifact(
    address: str, ticket: bytes, data, timeout_s: float, tls: ssl.SSLContext | None = None
) -> pb.PutResponse:
    """Redeem an OpenPutArtifact ticket: the bytes as one frame (from `data`, no copies
    without TLS; an `Arriving` buffer a piece at a time as they come), the commit with
    their CRC-32C, then the shard's PutResponse or its typed error. `tls`: see `connect`."""
    crc = 0
    try:
        with connect(address, timeout_s, tls) as sock:
            with refused_while_sending(sock, address, 1):
                sock.sendall(ticket)
                sock.sendall(HEADER.pack(OK, 0, 1, nbytes(data)))
                for _, piece in pieces(data, ARTIFACT_PIECE):
                    crc = crc32c(piece, crc)
                    sock.sendall(piece)
                sock.sendall(HEADER.pack(COMMIT, 0, 1, 4) + struct.pack("<I", crc))
            return put_reply(sock, address, 1)
    except OSError as error:
        raise Unavailable(f"data plane {address}: {error}") from error


def receive_artifact(
    address: str, ticket: bytes, size: int, timeout_s: float, tls: ssl.SSLContext | None = None
) -> bytearray:
    """Redeem an OpenFetchArtifact ticket for an artifact of `size` bytes: its bytes,
    checked against the CRC-32C stored with them (CorruptInTransit when they differ; an
    in-band error raises its typed error, socket failures Unavailable)."""
    try:
        with connect(address, timeout_s, tls) as sock:
            sock.sendall(ticket)
            magic, layer, count, got = read_frame_header(sock)
            if magic == ERROR:
                raise in_band_error(sock, got, layer, fetch=True)
            if (magic, layer, count, got) != (CHECKED, 0, 1, size):
                raise Unavailable(
                    f"data plane: frame {(magic, layer, count, got)} from {address}, "
                    f"expected the artifact's {size} bytes"
                )
            stored = bytearray(4)
            recv_exact(sock, memoryview(stored))
            buffer, crc = bytearray(size), 0
            view = memoryview(buffer)
            for start in range(0, size, ARTIFACT_PIECE):
                piece = view[start : start + ARTIFACT_PIECE]
                recv_exact(sock, piece)
                crc = crc32c(piece, crc)
            if crc != struct.unpack("<I", stored)[0]:
                raise CorruptInTransit("fetch_artifact: the artifact arrived corrupted")
            return buffer
    except OSError as error:
        raise Unavailable(f"data plane {address}: {error}") from error


def abandon(address: str, ticket: bytes, timeout_s: float, tls: ssl.SSLContext | None) -> None:
    """Redeem a ticket and hang up at once, so that the shard releases what it holds for it
    now rather than when it expires (best effort: a failure here changes nothing)."""
    with contextlib.suppress(OSError), connect(address, timeout_s, tls) as sock:
        sock.sendall(ticket)
