"""Prometheus metrics: each shard, decoder and gateway keeps its own registry and serves it
on its own HTTP port (`MetricsServer`), behind a bearer token.

Conventions (https://prometheus.io/docs/practices/naming/): names `vericache_<component>_
<what>_<unit>`, counters end in `_total`, sizes are bytes and times seconds. Labels are
bounded: methods and status codes are finite sets, and tenant names go through
`TenantLabels`, which gives the first `tenant_labels` tenants a component sees their own
value and folds every later one into `OTHER`. No label carries a token, a prompt or a key.

Every endpoint needs `Authorization: Bearer <token>` (the deployment's metrics token: a
Prometheus scrape config gives it as `authorization: {credentials: ...}`); it is served
over TLS with the component's certificate when the component serves TLS. What it shows
is for operators: shard-wide and per-tenant figures, never any tenant's data.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    generate_latest,
)

from prefix_store.errors import LimitExceeded
from prefix_store.shares import FairShare
from prefix_store.tls import TLSClientConfig, TLSConfig, client_context, server_context

log = logging.getLogger(__name__)

OTHER = "_other"
"""The tenant label of every tenant beyond a component's first `tenant_labels`."""
PATH = "/metrics"


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """A component's metrics endpoint."""

    port: int = 0
    """HTTP port (0 = a free one; the bound one is reported)."""
    token: str = field(default="", repr=False)
    """The bearer token a scrape must present (required: the endpoint is never open)."""
    tenant_labels: int = 32
    """Distinct tenant label values; later tenants are counted under `OTHER`."""
    max_connections: int = 8
    """Connections served at once, each on its own thread; a further one is refused when
    it is accepted (503 when it can be told, then closed), before any thread is taken."""
    timeout_s: float = 5.0
    """A connection's whole life (TLS handshake, request, reply): a slower one is cut."""

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("metrics token: required (the metrics endpoint is authenticated)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"metrics port must be in [0, 65536), got {self.port}")
        if self.tenant_labels < 1:
            raise ValueError("tenant_labels: must be >= 1")
        if self.max_connections < 1 or self.timeout_s <= 0:
            raise ValueError("metrics: max_connections must be >= 1 and timeout_s > 0")


class TenantLabels:
    """Bounded tenant label values: the first `limit` tenants seen keep their name."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._seen:
                return tenant
            if len(self._seen) < self.limit:
                self._seen.add(tenant)
                return tenant
        return OTHER


BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class BoundedHTTPServer(ThreadingHTTPServer):
    """An HTTP server whose thread per connection is taken only within `slots`, shared by
    peer address (`FairShare`: a peer alone holds at most half, and a new peer always finds
    one, so a slow client cannot lock a scraper out). The limit applies in the accept loop,
    so a connection over it is refused (a best-effort 503 on plain HTTP, then closed;
    counted in `refused`) before any thread exists. A connection that is not done within
    `deadline_s` in all is cut (its socket shut down), however slowly it trickles bytes in
    or reads the reply."""

    daemon_threads = True

    def __init__(self, address, handler, slots: int, deadline_s: float) -> None:
        super().__init__(address, handler, bind_and_activate=False)
        self.slots = FairShare(slots, "metrics connections", holder="peer")
        self.deadline_s = deadline_s
        self.refused = 0
        """Connections refused at accept (a figure for tests and operators)."""

    def process_request(self, request, client_address) -> None:
        peer = str(client_address[0])
        try:
            self.slots.acquire(peer)
        except LimitExceeded:
            self.refused += 1
            _refuse(request)
            return self.shutdown_request(request)
        try:
            super().process_request(request, client_address)  # its thread
        except BaseException:
            self.slots.release(peer)
            raise

    def process_request_thread(self, request, client_address) -> None:
        cut = threading.Timer(self.deadline_s, _cut, (request,))
        cut.daemon = True
        cut.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self.slots.release(str(client_address[0]))

    def handle_error(self, request, client_address) -> None:
        pass  # a cut or broken connection: nothing to log (and no traceback on stderr)


def _refuse(request: socket.socket) -> None:
    """Tell a plain-HTTP caller it was turned away, without ever waiting for it."""
    if isinstance(request, ssl.SSLSocket):
        return  # no handshake was made: nothing can be said
    with contextlib.suppress(OSError):
        request.setblocking(False)
        request.send(BUSY)


def _cut(request: socket.socket) -> None:
    """End a connection past its deadline: the socket itself is shut down (under TLS too),
    so the thread's blocked read or write returns at once."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(request, socket.SHUT_RDWR)


STOP_POLL_S = 0.1
"""How often the serving thread looks for `stop` (socketserver's default, 0.5 s, made
every stop of a shard, gateway or router wait half a second)."""


class MetricsServer:
    """Serves a registry at http(s)://host:port/metrics to callers with the token."""

    def __init__(
        self,
        registry: CollectorRegistry,
        config: MetricsConfig,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.config = config
        self._server = BoundedHTTPServer(
            (host, config.port), _handler(registry, config), config.max_connections,
            config.timeout_s,
        )  # fmt: skip
        self._server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.server_bind()
        self._server.server_activate()
        if tls is not None:
            context = server_context(tls)
            self._server.socket = context.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
        self.port = self._server.server_address[1]
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://{advertise_host or host}:{self.port}{PATH}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(STOP_POLL_S,), name="metrics", daemon=True
        )

    @property
    def refused(self) -> int:
        """Connections refused at accept (over `max_connections`)."""
        return self._server.refused

    def start(self) -> str:
        self._thread.start()
        return self.url

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


def metrics_endpoint(
    registry: CollectorRegistry,
    config: MetricsConfig | None,
    host: str,
    advertise_host: str | None = None,
    tls: TLSConfig | None = None,
) -> tuple[MetricsServer | None, str]:
    """A component's endpoint and its URL: (None, "") when `config` asks for none."""
    if config is None:
        return None, ""
    server = MetricsServer(registry, config, host, advertise_host, tls)
    return server, server.url


def _handler(registry: CollectorRegistry, config: MetricsConfig):
    expected = f"Bearer {config.token}".encode()

    class Handler(BaseHTTPRequestHandler):
        timeout = config.timeout_s
        server_version = "vericache-metrics"
        sys_version = ""

        def setup(self) -> None:
            if isinstance(self.request, ssl.SSLSocket):
                self.request.settimeout(config.timeout_s)
                self.request.do_handshake()
            super().setup()

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path.split("?", 1)[0] != PATH:
                return self._reply(404, b"not found; metrics are at /metrics\n")
            given = (self.headers.get("Authorization") or "").encode()
            if not hmac.compare_digest(given, expected):
                return self._reply(401, b"a bearer token is required\n", bearer=True)
            self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)

        def _reply(self, status: int, body: bytes, kind: str = "text/plain", bearer=False):
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            if bearer:
                self.send_header("WWW-Authenticate", 'Bearer realm="vericache metrics"')
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - the API's name
            pass  # no per-scrape log lines (nothing to learn; headers hold the token)

    return Handler


def scrape(url: str, token: str, timeout_s: float = 5.0, tls: TLSClientConfig | None = None) -> str:
    """The text exposition at `url` (`vericache status`); https verifies the server with
    `tls` (its CA; its client certificate under mTLS), else the system's roots. Raises
    OSError when unreachable and PermissionError when the token is refused."""
    import urllib.error
    import urllib.request

    context = None
    if url.startswith("https://"):
        context = client_context(tls) if tls is not None else ssl.create_default_context()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            return response.read().decode()
    except urllib.error.HTTPError as error:
        if error.code == 401:
            raise PermissionError(f"{url}: the metrics token was refused") from None
        raise OSError(f"{url}: HTTP {error.code}") from None
