"""The HTTP front door's server: the application (`app.api`) under uvicorn (h11), on its
own event loop thread, over a socket bound at construction (so its port is known and a
port in use fails there, as OSError).

Bounds beyond uvicorn's own (keep-alive, request head size): a connection must send a
whole request head within `header_timeout_s` of opening or of its previous response, else
it is closed, so that slow clients cannot hold connections open; past `max_connections`
a request gets OpenAI's error object with 503 (uvicorn's own limit answers in plain text);
both in `BoundedProtocol`. The application bounds the body (`app`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading

import uvicorn
from prometheus_client import CollectorRegistry
from uvicorn.protocols.http.h11_impl import H11Protocol

from decoder.http.app import Upstream, api
from decoder.http.config import HttpConfig
from decoder.http.openai import ApiError, Model
from prefix_store.client.loops import quiet_grpc_wakeups
from prefix_store.tls import TLSConfig, server_context

log = logging.getLogger(__name__)


BUSY = ApiError(503, "the server is at its connection limit; retry later")
BUSY_BODY = json.dumps(BUSY.body()).encode()


class BoundedProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head
    within `head_timeout_s` of opening or of its last response, and answering a request
    that finds `max_connections` connections open (or as many requests running) with
    OpenAI's error object, status 503, and the connection closed (uvicorn's
    `limit_concurrency`, whose answer is plain text)."""

    head_timeout_s = 10.0
    max_connections: int | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._app, self.app = self.app, self._bounded

    async def _bounded(self, scope, receive, send) -> None:
        # asked from inside the request: its own connection and task are counted
        limit = self.max_connections
        if limit is not None and (len(self.connections) > limit or len(self.tasks) > limit):
            log.warning("http: a request past the connection limit (%d) got 503", limit)
            await _busy(send)
        else:
            await self._app(scope, receive, send)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(None)

    def on_response_complete(self) -> None:
        finished = self.cycle  # (a pipelined request's cycle may start inside super())
        super().on_response_complete()
        self._arm(finished)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, waiting_for) -> None:
        """Close the connection unless a request head after `waiting_for` (the cycle that
        just ended; None: none yet) arrives in time."""
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._late, waiting_for)

    def _disarm(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _late(self, waiting_for) -> None:
        self._head_timer = None
        if self.cycle is waiting_for and not self.transport.is_closing():
            self.transport.close()


async def _busy(send) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BUSY_BODY)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": BUSY_BODY, "more_body": False})


class HttpServer:
    """The OpenAI-compatible API of one Decoder service."""

    def __init__(
        self,
        config: HttpConfig,
        model: Model,
        upstream: Upstream,
        registry: CollectorRegistry,
        tls: TLSConfig | None = None,
    ) -> None:
        self.config = config
        self.sock = _bound(config.host, config.port)
        self.port = self.sock.getsockname()[1]
        self.scheme = "https" if tls is not None else "http"
        bounds = {"head_timeout_s": config.header_timeout_s,
                  "max_connections": config.max_connections}  # fmt: skip
        protocol = type("Protocol", (BoundedProtocol,), bounds)
        self._uvicorn = uvicorn.Server(
            uvicorn.Config(
                api(config, model, upstream, registry),
                http=protocol,
                lifespan="on",
                log_level="warning",
                access_log=False,
                server_header=False,
                timeout_keep_alive=config.keep_alive_s,
                h11_max_incomplete_event_size=config.max_header_bytes,
                ssl_context_factory=None if tls is None else (lambda c, d: server_context(tls)),
                timeout_graceful_shutdown=5,
            )
        )
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Serve (on a thread of its own); the port, once it accepts connections."""
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)
        self._thread.start()
        while not self._uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server failed to start (see the log)")
            self._thread.join(0.02)
        return self.port

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        # this loop's grpc.aio shares its wake-ups with any other loop in the process
        quiet_grpc_wakeups(asyncio.get_running_loop())
        await self._uvicorn.serve(sockets=[self.sock])

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.sock.close()


def _bound(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock
