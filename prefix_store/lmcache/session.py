"""One LMCache connection: read a frame, answer it, in order, until the peer leaves.

Frames on a connection are handled one after another, so a reply means every PUT before it
on that connection was stored or refused (LMCache's own server behaves the same way).
Failures tied to one request fail that request alone: a store error makes a PUT unstored
(the protocol has no PUT reply: the key stays a miss, or keeps its earlier object) and a
GET or EXIST a miss; the connection goes on. A frame that cannot be parsed, a stalled peer
or a broken socket ends this connection only.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import Counter
from concurrent.futures import Executor

from prefix_store.client.arriving import Arriving
from prefix_store.errors import StoreError
from prefix_store.lmcache.errors import ProtocolError
from prefix_store.lmcache.objects import Envelope, ObjectStore
from prefix_store.lmcache.protocol import (
    ClientHeader,
    Command,
    ReturnCode,
    parse_client_header,
    reply,
)

log = logging.getLogger("prefix_store.lmcache")


class Closed(Exception):
    """The peer closed its side."""


class GatewayStats:
    """What the gateway did, by event name (thread-safe)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, event: str, n: int = 1) -> None:
        with self._lock:
            self._counts[event] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class Session:
    """Serves one accepted socket until the peer leaves or a frame is bad."""

    def __init__(
        self,
        sock: socket.socket,
        objects: ObjectStore,
        stats: GatewayStats,
        max_object_bytes: int,
        io_timeout_s: float,
        idle_timeout_s: float,
        storing: Executor,
    ) -> None:
        """`storing`: where a PUT is stored from while this session receives it."""
        self.sock, self.objects, self.stats = sock, objects, stats
        self.storing = storing
        self.max_object_bytes = max_object_bytes
        self.io_timeout_s, self.idle_timeout_s = io_timeout_s, idle_timeout_s
        self.busy = False
        """Whether a frame is being served (a stopping gateway lets it finish)."""

    def run(self) -> None:
        try:
            while self.serve_one():
                pass
        except ProtocolError as error:
            self.stats.count("protocol_errors")
            log.warning("lmcache gateway: closing a connection: %s", error)
        except (Closed, OSError):
            pass  # the peer left, stalled or reset: only this connection ends
        finally:
            self.sock.close()

    def serve_one(self) -> bool:
        """Read and answer one frame; False when the peer closed between frames."""
        frame = bytearray(ClientHeader.SIZE)
        if not self._read_into(memoryview(frame), first=True):
            return False
        header = parse_client_header(bytes(frame), self.max_object_bytes)
        handler = {
            Command.PUT: self.put,
            Command.GET: self.get,
            Command.EXIST: self.exist,
            Command.HEALTH: self.health,
            Command.LIST: self.list_keys,
        }[header.command]
        handler(header)
        self.busy = False
        return True

    # ---- commands ---------------------------------------------------------------------

    def put(self, header: ClientHeader) -> None:
        """The payload straight into the stored object's final buffer (its length already
        checked against `max_object_bytes`), stored from that buffer while it arrives: the
        store sends each piece on as soon as it is in (`Arriving`), on a thread of the
        gateway's `storing` pool. A payload that stops short stores nothing."""
        stored, payload = Envelope.buffer(header.key, header.meta, header.length)
        head = stored.nbytes - payload.nbytes
        arriving = Arriving(stored, filled=head)
        storing = self.storing.submit(self._store, header, arriving)
        try:
            self._read_into(payload, progress=lambda got: arriving.arrived(head + got))
        except BaseException as error:
            arriving.failed(error)
            raise
        finally:
            storing.result()

    def _store(self, header: ClientHeader, arriving: Arriving) -> None:
        try:
            self.objects.put(header.key, arriving)
            self.stats.count("puts")
            self.stats.count("bytes_in", header.length)
        except StoreError as error:
            self.stats.count(f"put_refused:{type(error).__name__}")
            log.warning("lmcache gateway: a PUT was not stored: %s", error)

    def get(self, header: ClientHeader) -> None:
        found = self._ask("get", self.objects.get, header.key)
        if found is None:
            self.stats.count("get_misses")
            self._send(reply(ReturnCode.FAIL))
            return
        meta, payload = found
        self.stats.count("get_hits")
        self.stats.count("bytes_out", len(payload))
        self._send(reply(ReturnCode.SUCCESS, len(payload), meta), payload)

    def exist(self, header: ClientHeader) -> None:
        present = bool(self._ask("exist", self.objects.exists, header.key))
        self.stats.count("exist_hits" if present else "exist_misses")
        self._send(reply(ReturnCode.SUCCESS if present else ReturnCode.FAIL))

    def health(self, header: ClientHeader) -> None:
        self._send(reply(ReturnCode.SUCCESS))

    def list_keys(self, header: ClientHeader) -> None:
        self._send(reply(ReturnCode.FAIL))  # LMCache 0.5.6's server does not list either

    def _ask(self, what: str, call, key: str):
        """`call(key)`, or None (a miss) when the store fails it."""
        try:
            return call(key)
        except StoreError as error:
            self.stats.count(f"{what}_failed:{type(error).__name__}")
            log.warning("lmcache gateway: a %s failed (answered as a miss): %s", what, error)
            return None

    # ---- socket I/O -------------------------------------------------------------------

    def _read_into(self, view: memoryview, first: bool = False, progress=None) -> bool:
        """Fill `view`; False if the peer closed before its first byte when `first`.
        `progress(got)` is told the bytes in so far after each read."""
        got = 0
        self.sock.settimeout(self.idle_timeout_s if first else self.io_timeout_s)
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                if first and got == 0:
                    return False
                raise Closed
            if got == 0:
                self.busy = True
                self.sock.settimeout(self.io_timeout_s)
            got += n
            if progress is not None:
                progress(got)
        return True

    def _send(self, head: bytes, payload: memoryview | None = None) -> None:
        """Send the reply; each send may stall at most `io_timeout_s` (not the whole)."""
        self.sock.settimeout(self.io_timeout_s)
        for part in (memoryview(head), payload):
            while part:
                part = part[self.sock.send(part) :]
