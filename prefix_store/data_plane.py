"""The shard's bulk data plane: fetched KV over a plain TCP connection.

gRPC stays the contract (auth, validation, leases, errors: `OpenFetch` does all of it and
returns a ticket); this only moves bytes. A layer goes out with scatter-gather `sendmsg`
straight from the stored segments and lands, on the client, straight in the caller's
tensors (`recv_into`): the payload is copied once by each kernel and never by Python,
where gRPC's own path copies it three to four more times.

The frames both ends speak are `prefix_store.protocol.frames`; here are the server's
tickets, connections and bounds.

With TLS (`ShardConfig.tls`) every connection is a TLS session first: the handshake runs in
the connection's own thread under its idle timeout (a client that never completes it holds
nothing but that thread, and is cut like any idle connection), then the same frames flow
inside it. A plaintext client's bytes fail the handshake and the connection is closed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prefix_store import faults
from prefix_store.config import DataPlaneLimits
from prefix_store.errors import LimitExceeded
from prefix_store.protocol.frames import (
    CHECKED,
    HEADER,
    PROOF_BYTES,
    TICKET_BYTES,
    error_frame,
    pack_crcs,
    recv_exact,
    send_buffers,
    tune,
)
from prefix_store.shares import FairShare
from prefix_store.status import BUSY_RETRY_MS
from rpc.status import STORE

log = logging.getLogger(__name__)


@dataclass
class Transfer:
    """What a ticket grants: `run(conn)` moves the bytes; `close()` always runs after it (or
    when the ticket expires unused) and releases what the transfer held."""

    run: Callable[[socket.socket], None]
    close: Callable[[], None]
    expires: float
    peer: str = ""
    """The address the ticket was issued to ("" = any): only it may redeem it."""
    nbytes: int = 0
    """What the transfer moves; with `DataPlaneLimits.min_rate` it sets its deadline."""
    owner_key: bytes = b""
    """`token_key` of the tenant it was issued to (b"" = any): only its proof redeems it."""
    ticket: bytes = b""
    tenant: str = ""
    """The tenant it was issued to: its ticket and connection count against its shares."""
    weight: float = 1.0
    """That tenant's weight in the plane's fair shares."""

    def redeemable(self, peer: str, proof: bytes) -> bool:
        """Whether a connection from `peer` opening with `proof` may redeem the ticket."""
        if self.peer and self.peer != peer:
            return False
        if not self.owner_key:
            return True
        expected = hmac.new(self.owner_key, self.ticket, hashlib.sha256).digest()
        return hmac.compare_digest(expected, proof)


def send_frames(sock: socket.socket, frames: Iterator[tuple[int, list, list]]) -> None:
    """Send (layer, each chunk's stored CRC-32C, buffers in wire order) fetch frames."""
    for layer, crcs, buffers in frames:
        size = sum(b.nbytes for b in buffers)
        sock.sendall(HEADER.pack(CHECKED, layer, len(crcs), size) + pack_crcs(crcs))
        send_buffers(sock, faults.TRANSIT.tamper(buffers))


def head_major(segments: list, tokens: list[int], kv_heads: int, row_bytes: int) -> list:
    """One layer's stored segments (per chunk: K heads then V heads) as views in wire order
    (K then V, per head, per chunk)."""
    return [view for _, view in head_major_pieces(segments, tokens, kv_heads, row_bytes)]


def head_major_pieces(
    segments: list, tokens: list[int], kv_heads: int, row_bytes: int
) -> list[tuple[int, memoryview]]:
    """As `head_major`, each view with the index of the segment it is in."""
    views = [memoryview(s).cast("B") for s in segments]
    out = []
    for half in range(2):
        for head in range(kv_heads):
            for index, (view, n) in enumerate(zip(views, tokens, strict=True)):
                block = n * row_bytes
                start = (half * kv_heads + head) * block
                out.append((index, view[start : start + block]))
    return out


def refuse(conn: socket.socket, error: BaseException) -> None:
    """Tell a connection its bounds refused it (RESOURCE_EXHAUSTED, naming the limit, marked
    busy: try again after `BUSY_RETRY_MS`), and close it."""
    with contextlib.suppress(OSError), conn:
        conn.settimeout(1)
        conn.sendall(error_frame("RESOURCE_EXHAUSTED", str(error), BUSY_RETRY_MS))


def _shut(sock: socket.socket) -> None:
    """End a connection from another thread: its blocked read returns at once (TLS too)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class DataPlane:
    """A listener whose connections each redeem one ticket and stream its segments.

    Bounded (see `DataPlaneLimits`): tickets and connections by fair share among tenants
    (`prefix_store.shares`), connections not yet redeemed per peer address and by a short
    handshake deadline, idle time and each transfer's duration. The accept loop survives
    every error (e.g. EMFILE: it backs off and goes on; `accept_errors` counts them) and
    ends only at `stop`. A ticket is redeemable only from the address it was issued to.
    `tls`: a server-side context (`prefix_store.tls.server_context`) every connection must
    complete a handshake with before anything else; None: plain TCP."""

    def __init__(
        self,
        host: str,
        port: int = 0,
        limits: DataPlaneLimits | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.limits = limits or DataPlaneLimits()
        self._tls = tls
        self.ticket_ttl_s = self.limits.ticket_ttl_s
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._tickets: dict[bytes, Transfer] = {}
        self._ticket_shares = FairShare(self.limits.max_tickets, "data-plane tickets")
        self._connection_shares = FairShare(self.limits.max_connections, "data-plane connections")
        self._opening = FairShare(
            self.limits.max_opening,
            "data-plane connections not yet redeemed",
            limit=self.limits.opening_per_peer,
            holder="peer",
        )
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._connections: dict[socket.socket, float] = {}
        """Open connections and the monotonic time by which each must be done."""
        self._pending: dict[str, dict[int, tuple[socket.socket, list[str]]]] = {}
        """Per peer address, its connections not yet redeemed, oldest first: (the socket,
        the opening slot it holds: [peer] until settled, then [])."""
        self.accept_errors = 0
        """accept() calls that failed (EMFILE, ENFILE, ENOBUFS...) while listening: each was
        logged, backed off from and retried. Written by the accept thread only."""
        self._thread = threading.Thread(target=self._accept, name="data-plane", daemon=True)
        self._reaper = threading.Thread(target=self._reap, name="ticket-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._reaper.start()

    def _reap(self) -> None:
        """Expire unused tickets (releasing their leases) and cut transfers past their
        deadline, even when nothing new arrives."""
        while not self._stopped.wait(min(1.0, self.ticket_ttl_s / 2)):
            now = time.monotonic()
            self._expire(now)
            self._cut_overdue(now)

    def issue(
        self,
        run: Callable[[socket.socket], None],
        close: Callable[[], None],
        peer: str = "",
        nbytes: int = 0,
        owner_key: bytes = b"",
        tenant: str = "",
        weight: float = 1.0,
    ) -> bytes:
        """Register a transfer for `peer` (an address; "" = any) and the tenant whose
        `token_key` is `owner_key` (b"" = any), named `tenant` (weight `weight`); returns its
        single-use ticket. LimitExceeded when the tenant holds its share of `max_tickets`
        (the caller releases what the transfer held)."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        self._expire(time.monotonic())
        self._ticket_shares.acquire(tenant, 1, weight)
        with self._lock:
            expires = time.monotonic() + self.ticket_ttl_s
            self._tickets[ticket] = Transfer(
                run, close, expires, peer, nbytes, owner_key, ticket, tenant, weight
            )
        return ticket

    def load(self) -> tuple[int, int]:
        """Tickets waiting to be redeemed, and connections open (operators' metrics)."""
        with self._lock:
            return len(self._tickets), len(self._connections)

    def _expire(self, now: float) -> None:
        with self._lock:
            expired = [t for t, x in self._tickets.items() if x.expires < now]
            transfers = [self._tickets.pop(t) for t in expired]
        for transfer in transfers:  # outside the lock: closing takes the shard's lock
            self._ticket_shares.release(transfer.tenant)
            transfer.close()

    def _cut_overdue(self, now: float) -> None:
        with self._lock:
            overdue = [c for c, deadline in self._connections.items() if deadline < now]
        for conn in overdue:
            log.warning("data plane: a transfer passed its deadline; cut")
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        backoff = 0.01
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as error:
                if self._stopped.is_set():
                    return
                self.accept_errors += 1
                log.warning("data plane: accept failed (%s); retrying in %.2f s", error, backoff)
                self._stopped.wait(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            backoff = 0.01
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """A new connection, unauthenticated until it redeems a ticket: it holds one of its
        peer address's opening slots and must open within `handshake_s`. A peer at its
        limit gets the slot of its own oldest connection still opening, which is cut: idle
        connections cannot lock out a client at the same address, which redeems at once."""
        try:
            peer = conn.getpeername()[0].removeprefix("::ffff:")
            opening = self._opening_slot(peer)
        except (OSError, LimitExceeded) as error:
            refuse(conn, error)
            return
        with self._lock:
            self._connections[conn] = time.monotonic() + self.limits.handshake_s
            self._pending.setdefault(peer, {})[id(opening)] = (conn, opening)
        try:
            threading.Thread(target=self._serve, args=(conn, opening), daemon=True).start()
        except RuntimeError:  # no thread to be had: as if full
            self._forget(conn)
            self._settle(opening)
            conn.close()

    def _opening_slot(self, peer: str) -> list[str]:
        """An opening slot for a new connection from `peer`: its share's, else the one its
        oldest unredeemed connection held (that connection is cut); LimitExceeded when the
        peer has none to give up."""
        try:
            self._opening.acquire(peer)
            return [peer]
        except LimitExceeded:
            with self._lock:
                queue = self._pending.get(peer)
                if not queue:
                    raise
                oldest, (old, held) = next(iter(queue.items()))
                del queue[oldest]
                held.clear()  # the slot moves: the old connection's end releases nothing
            _shut(old)
            return [peer]

    def _settle(self, opening: list[str]) -> None:
        """The connection holding `opening` redeemed its ticket or ended: its slot goes back
        (unless another connection took it over)."""
        with self._lock:
            if not opening:
                return
            peer = opening.pop()
            queue = self._pending.get(peer, {})
            queue.pop(id(opening), None)
            if not queue:
                self._pending.pop(peer, None)
            self._opening.release(peer)

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.pop(conn, None)

    def _serve(self, conn: socket.socket, opening: list[str]) -> None:
        try:
            conn = self._wrap(conn)
            self._stream(conn, opening)
        finally:
            self._forget(conn)
            self._settle(opening)

    def _wrap(self, conn: socket.socket) -> socket.socket:
        """With TLS: the connection as a TLS socket, its handshake not yet done (no I/O
        here), registered in the plain socket's place so that cuts reach it."""
        if self._tls is None:
            return conn
        secure = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        with self._lock:
            deadline = self._connections.pop(conn, None)
            if deadline is not None:
                self._connections[secure] = deadline
        return secure

    def _handshake(self, conn: socket.socket) -> bool:
        """Complete the TLS handshake (under the connection's timeout); False if it failed:
        a plaintext client, an untrusted or missing client certificate, a timeout."""
        if not isinstance(conn, ssl.SSLSocket):
            return True
        try:
            conn.do_handshake()
        except OSError as error:  # ssl.SSLError included
            log.info("data plane: TLS handshake failed: %s", error)
            return False
        return True

    def _stream(self, conn: socket.socket, opening: list[str]) -> None:
        with conn:
            tune(conn)
            conn.settimeout(min(self.limits.idle_s, self.limits.handshake_s))
            if self._stopped.is_set() or not self._handshake(conn):
                return
            transfer = self._redeem(conn)
            if transfer is None:
                return
            self._settle(opening)
            try:
                self._connection_shares.acquire(transfer.tenant, 1, transfer.weight)
            except LimitExceeded as error:
                transfer.close()
                refuse(conn, error)
                return
            try:
                self._transfer(conn, transfer)
            finally:
                self._connection_shares.release(transfer.tenant)

    def _transfer(self, conn: socket.socket, transfer: Transfer) -> None:
        """Move a redeemed transfer's bytes under its deadline; `close` it always."""
        conn.settimeout(self.limits.idle_s)
        with self._lock:
            if conn in self._connections:
                deadline = self.limits.deadline(transfer.nbytes)
                self._connections[conn] = time.monotonic() + deadline
        try:
            transfer.run(conn)
        except OSError as error:  # the client went away, or was too slow: nobody to tell
            log.info("data plane: transfer aborted: %s", error)
        except Exception as error:  # noqa: BLE001 - report it in band, then close
            if STORE.code_of(error).name == "INTERNAL":
                log.exception("data plane: internal error")
            busy = BUSY_RETRY_MS if isinstance(error, LimitExceeded) else None
            with contextlib.suppress(OSError):
                conn.sendall(error_frame(STORE.code_of(error).name, str(error), busy))
        finally:
            transfer.close()

    def _redeem(self, conn: socket.socket) -> Transfer | None:
        opening = bytearray(TICKET_BYTES + PROOF_BYTES)
        try:
            recv_exact(conn, memoryview(opening))
            peer = conn.getpeername()[0].removeprefix("::ffff:")
        except (OSError, ConnectionError):
            return None
        ticket, proof = bytes(opening[:TICKET_BYTES]), bytes(opening[TICKET_BYTES:])
        with self._lock:
            transfer = self._tickets.get(ticket)
            if transfer is not None and not transfer.redeemable(peer, proof):
                transfer = None  # not yours: the ticket stays for its owner
            elif transfer is not None:
                del self._tickets[ticket]
        if transfer is not None:
            self._ticket_shares.release(transfer.tenant)
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
            self._ticket_shares.release(transfer.tenant)
            transfer.close()
