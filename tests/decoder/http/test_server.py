"""The HTTP server's own bounds, on a live uvicorn over loopback (its routes that need no
decoder: `/health`)."""

from __future__ import annotations

import json
import socket

import pytest
from prometheus_client import CollectorRegistry

from decoder.http.app import Upstream
from decoder.http.config import HttpConfig
from decoder.http.openai import Model, control_tokens
from decoder.http.server import HttpServer
from decoder.router.server import load_tokenizer
from tests.waiting import eventually

HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture
def server():
    tokenizer = load_tokenizer(None)
    model = Model("smollm2-135m-instruct", 8192, tokenizer, control_tokens(tokenizer))
    upstream = Upstream("unix:/nonexistent", lambda token, peer: None)
    config = HttpConfig(max_connections=2, header_timeout_s=30.0, keep_alive_s=30)
    http = HttpServer(config, model, upstream, CollectorRegistry())
    http.start()
    yield http
    http.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def ask(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Send GET /health; (status, headers, body) of the reply."""
    sock.sendall(HEALTH)
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    head, _, body = head.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        body += sock.recv(4096)
    return int(lines[0].split()[1]), headers, body


def test_past_max_connections_a_request_gets_openais_503_and_the_others_are_served(server):
    idle = [connect(server.port) for _ in range(2)]
    assert ask(idle[0])[0] == 200  # both connections are open and served
    with connect(server.port) as third:
        status, headers, body = ask(third)
        assert status == 503 and headers["content-type"] == "application/json"
        assert headers["connection"] == "close" and int(headers["retry-after"]) >= 1
        error = json.loads(body)["error"]
        assert error["type"] == "service_unavailable" and "connection limit" in error["message"]
        assert third.recv(1) == b""  # closed after its answer
    assert ask(idle[1])[0] == 200  # the connections within the bound go on
    idle[0].close()

    def served() -> bool:
        with connect(server.port) as fresh:
            return ask(fresh)[0] == 200

    assert eventually(served)  # once the server has seen the close
    idle[1].close()
