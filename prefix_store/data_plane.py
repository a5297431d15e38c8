"""The shard's bulk data plane: fetched KV over a plain TCP connection.

gRPC stays the contract (auth, validation, leases, errors: `OpenFetch` does all of it and
returns a ticket); this only moves bytes. A layer goes out with scatter-gather `sendmsg`
straight from the stored segments and lands, on the client, straight in the caller's
tensors (`recv_into`): the payload is copied once by each kernel and never by Python,
where gRPC's own path copies it three to four more times.

Puts go the same way in the other direction (`OpenPut`): the client sends one frame per
layer from its tensors, then a commit frame b"VCCM" carrying each chunk's CRC-32C (u32
each); the shard answers b"VCOK" with a serialised PutResponse, or b"VCER".

One frame per layer: 16 bytes header (magic b"VCL1", u32 layer, u32 chunks, u32 n), then n
bytes ordered as the client's tensors are: K then V; per KV head; per chunk (request
order) that head's rows [tokens, head_dim]. So a run of consecutive chunks is one
contiguous region per head on both sides. Every segment of a layer passes its checksum
before the layer is sent; a failure is a frame b"VCER" whose n bytes are UTF-8
"STATUS_CODE_NAME\nmessage" (the gRPC code the same failure has there), after which the
connection closes.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prefix_store.status import code_of

log = logging.getLogger(__name__)
HEADER = struct.Struct("<4sIII")
OK = b"VCL1"
COMMIT = b"VCCM"
DONE = b"VCOK"
IOV_BATCH = 512
ERROR = b"VCER"
TICKET_BYTES = 16
SOCKET_BUFFER = 4 << 20


@dataclass
class Transfer:
    """What a ticket grants: `run(conn)` moves the bytes; `close()` always runs after it (or
    when the ticket expires unused) and releases what the transfer held."""

    run: Callable[[socket.socket], None]
    close: Callable[[], None]
    expires: float


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill a flat (format "B") view."""
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the peer closed the data connection mid-transfer")
        view = view[n:]


def send_frames(sock: socket.socket, frames: Iterator[tuple[int, int, list]]) -> None:
    """Send (layer, chunks, buffers in wire order) frames."""
    for layer, chunks, buffers in frames:
        size = sum(b.nbytes for b in buffers)
        sock.sendall(HEADER.pack(OK, layer, chunks, size))
        send_buffers(sock, buffers)


def error_frame(code: str, message: str) -> bytes:
    text = f"{code}\n{message}".encode()[:65536]
    return HEADER.pack(ERROR, 0, 0, len(text)) + text


def read_frame_header(sock: socket.socket) -> tuple[bytes, int, int, int]:
    header = bytearray(HEADER.size)
    recv_exact(sock, memoryview(header))
    return HEADER.unpack(header)


def read_error(sock: socket.socket, size: int) -> tuple[str, str]:
    """(status code name, message) of an error frame whose header has been read."""
    body = bytearray(min(size, 65536))
    recv_exact(sock, memoryview(body))
    code, _, message = body.decode(errors="replace").partition("\n")
    return code, message


def head_major(segments: list, tokens: list[int], kv_heads: int, row_bytes: int) -> list:
    """One layer's stored segments (per chunk: K heads then V heads) as views in wire order
    (K then V, per head, per chunk)."""
    views = [memoryview(s).cast("B") for s in segments]
    out = []
    for half in range(2):
        for head in range(kv_heads):
            for view, n in zip(views, tokens, strict=True):
                block = n * row_bytes
                start = (half * kv_heads + head) * block
                out.append(view[start : start + block])
    return out


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """sendmsg the buffers in order, resuming after partial sends."""
    pending = [b for b in buffers if b.nbytes]
    first = 0
    while first < len(pending):
        sent = sock.sendmsg(pending[first : first + IOV_BATCH])
        while sent and first < len(pending):
            size = pending[first].nbytes
            if sent >= size:
                sent -= size
                first += 1
            else:
                pending[first] = pending[first][sent:]
                sent = 0


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


class DataPlane:
    """A listener whose connections each redeem one ticket and stream its segments."""

    def __init__(self, host: str, port: int = 0, ticket_ttl_s: float = 30.0) -> None:
        self.ticket_ttl_s = ticket_ttl_s
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._tickets: dict[bytes, Transfer] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._connections: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="data-plane", daemon=True)
        self._reaper = threading.Thread(target=self._reap, name="ticket-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._reaper.start()

    def _reap(self) -> None:
        """Expire unused tickets (releasing their leases) even when no new ones are issued."""
        while not self._stopped.wait(min(1.0, self.ticket_ttl_s / 2)):
            self._expire(time.monotonic())

    def issue(self, run: Callable[[socket.socket], None], close: Callable[[], None]) -> bytes:
        """Register a transfer; returns its single-use ticket."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        self._expire(time.monotonic())
        with self._lock:
            self._tickets[ticket] = Transfer(run, close, time.monotonic() + self.ticket_ttl_s)
        return ticket

    def _expire(self, now: float) -> None:
        with self._lock:
            expired = [t for t, x in self._tickets.items() if x.expires < now]
            transfers = [self._tickets.pop(t) for t in expired]
        for transfer in transfers:  # outside the lock: closing takes the shard's lock
            transfer.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.add(conn)
        try:
            self._stream(conn)
        finally:
            with self._lock:
                self._connections.discard(conn)

    def _stream(self, conn: socket.socket) -> None:
        with conn:
            tune(conn)
            conn.settimeout(60)
            transfer = self._redeem(conn)
            if transfer is None:
                return
            try:
                transfer.run(conn)
            except OSError as error:  # the client went away: nothing to report to
                log.info("data plane: transfer aborted: %s", error)
            except Exception as error:  # noqa: BLE001 - report it in band, then close
                if code_of(error).name == "INTERNAL":
                    log.exception("data plane: internal error")
                with contextlib.suppress(OSError):
                    conn.sendall(error_frame(code_of(error).name, str(error)))
            finally:
                transfer.close()

    def _redeem(self, conn: socket.socket) -> Transfer | None:
        ticket = bytearray()
        try:
            while len(ticket) < TICKET_BYTES:
                part = conn.recv(TICKET_BYTES - len(ticket))
                if not part:
                    return None
                ticket += part
        except OSError:
            return None
        with self._lock:
            transfer = self._tickets.pop(bytes(ticket), None)
        if transfer is not None and transfer.expires < time.monotonic():
            transfer.close()
            transfer = None
        if transfer is None:
            with contextlib.suppress(OSError):
                conn.sendall(error_frame("UNAVAILABLE", "unknown or expired ticket"))
        return transfer

    def stop(self) -> None:
        """Stop listening and cut every transfer in flight (clients fail over)."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for conn in self._connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            transfers = list(self._tickets.values())
            self._tickets.clear()
        for transfer in transfers:
            transfer.close()
