"""The LMCache gateway: a TCP server speaking LMCache's `lm://` protocol, storing through
the prefix store as one configured tenant (`GatewayConfig`).

A thread accepts connections and each admitted one is served by its own thread
(`session.Session`). LMCache's protocol carries no credentials, so a connection is admitted
only from a process of this host's gateway user or of `allowed_uids` (`peers.peer_uid`),
and only while fewer than `max_connections` are open; any other is closed at once and
counted (`connections_refused_uid`, `connections_refused`). The store is
reached through one `StoreClient` (thread-safe) whose objects live in the configured
namespace (`objects.ObjectStore`): replication, checksums, quotas and authentication are
the store's own.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from prefix_store.client import StoreClient
from prefix_store.errors import NotFound, StoreError, Unauthenticated
from prefix_store.lmcache.config import GatewayConfig
from prefix_store.lmcache.errors import GatewayError
from prefix_store.lmcache.metrics import registry
from prefix_store.lmcache.objects import ObjectStore
from prefix_store.lmcache.peers import peer_uid
from prefix_store.lmcache.session import GatewayStats, Session
from prefix_store.metrics import metrics_endpoint

log = logging.getLogger("prefix_store.lmcache")

ACCEPT_POLL_S = 0.2
"""How often the accept loop looks whether the gateway is stopping."""


class LMCacheGateway:
    """`start()` connects to the store as the configured tenant and serves; `stop()` ends
    every connection and the store client. Usable as a context manager."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.stats = GatewayStats()
        self.client: StoreClient | None = None
        self.objects: ObjectStore | None = None
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._sessions: dict[socket.socket, tuple[threading.Thread, Session]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._storing = ThreadPoolExecutor(config.max_connections, "lmcache-gateway-store")
        """Stores each PUT while its session receives it (one at a time per connection)."""
        self._uids = frozenset((os.getuid(), *config.allowed_uids))
        """Users whose processes may connect."""
        self.metrics, self.metrics_url = metrics_endpoint(registry(self), config.metrics,
                                                          config.host)  # fmt: skip

    @property
    def address(self) -> str:
        """host:port LMCache dials (`remote_url: lm://host:port`)."""
        if self._listener is None:
            raise GatewayError("the gateway is not started")
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> str:
        """Connect to the store, bind, accept; returns the address. GatewayError when the
        store refuses the token, the namespace is unknown or the port cannot be bound."""
        self.client = connect(self.config)
        try:
            self.objects = object_store(self.client, self.config.namespace)
            self._listener = listen(self.config.host, self.config.port)
        except BaseException:
            self.client.close()
            raise
        self._accepting = threading.Thread(
            target=self._accept_loop, name="lmcache-gateway-accept", daemon=True
        )
        self._accepting.start()
        if self.metrics is not None:
            self.metrics.start()
        log.info("lmcache gateway serving on %s", self.address)
        return self.address

    def stop(self) -> None:
        """Stop accepting, give requests in progress `stop_grace_s`, close everything."""
        self._stopping.set()
        if self._accepting is not None:
            self._accepting.join()
        with self._lock:
            sessions = dict(self._sessions)
        for sock, (_, session) in sessions.items():
            if not session.busy:
                shut(sock)  # idle between frames: nothing to finish
        deadline = time.monotonic() + self.config.stop_grace_s
        for thread, _ in sessions.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        for sock, (thread, _) in sessions.items():
            shut(sock)
            thread.join()
        self._storing.shutdown(wait=True)
        if self.client is not None:
            self.client.close()
        if self.metrics is not None:
            self.metrics.stop()

    def __enter__(self) -> LMCacheGateway:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def connections(self) -> int:
        with self._lock:
            return len(self._sessions)

    # ---- accepting ----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        try:
            while not self._stopping.is_set():
                try:
                    sock, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError as error:  # EMFILE, ENFILE, ENOBUFS: back off, keep serving
                    log.warning(
                        "lmcache gateway: accept failed: %s",
                        errno.errorcode.get(error.errno, error),
                    )
                    time.sleep(ACCEPT_POLL_S)
                    continue
                self._admit(sock)
        finally:
            self._listener.close()

    def _admit(self, sock: socket.socket) -> None:
        uid = peer_uid(sock)
        if uid not in self._uids:
            self.stats.count("connections_refused_uid")
            log.warning("lmcache gateway: closing a connection of uid %s (not allowed)", uid)
            sock.close()
            return
        with self._lock:
            if len(self._sessions) >= self.config.max_connections:
                self.stats.count("connections_refused")
                log.warning(
                    "lmcache gateway: %d connections open (max_connections); closing a new one",
                    len(self._sessions),
                )
                sock.close()
                return
            session = self._session(sock)
            thread = threading.Thread(
                target=self._serve, args=(sock, session), name="lmcache-gateway-conn", daemon=True
            )
            self._sessions[sock] = (thread, session)
        self.stats.count("connections")
        thread.start()

    def _session(self, sock: socket.socket) -> Session:
        assert self.objects is not None
        config = self.config
        return Session(
            sock,
            self.objects,
            self.stats,
            config.max_object_bytes,
            config.io_timeout_s,
            config.idle_timeout_s,
            self._storing,
        )

    def _serve(self, sock: socket.socket, session: Session) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session.run()
        except Exception:  # noqa: BLE001 - a bug in one connection must not end the gateway
            log.exception("lmcache gateway: a connection failed")
            sock.close()
        finally:
            with self._lock:
                self._sessions.pop(sock, None)


def connect(config: GatewayConfig) -> StoreClient:
    """The gateway's store client, or GatewayError saying why the store refused it."""
    try:
        return StoreClient(list(config.endpoints), config.token, config.client_config())
    except Unauthenticated:
        raise GatewayError(
            "lmcache gateway: the store does not accept the configured tenant token "
            "(GatewayConfig.token: UNAUTHENTICATED); check it or rotate it"
        ) from None
    except StoreError as error:
        raise GatewayError(f"lmcache gateway: cannot reach the store: {error}") from None


def object_store(client: StoreClient, namespace: str) -> ObjectStore:
    try:
        return ObjectStore(client, namespace)
    except NotFound:
        raise GatewayError(
            f"lmcache gateway: namespace {namespace!r} is not visible to the configured "
            "tenant (GatewayConfig.namespace)"
        ) from None


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.settimeout(ACCEPT_POLL_S)
    except OSError as error:
        sock.close()
        raise GatewayError(f"lmcache gateway: cannot listen on {host}:{port}: {error}") from None
    return sock


def shut(sock: socket.socket) -> None:
    """Wake a thread blocked on `sock` (its session then closes it)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
