"""The HTTP front door's typed configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """Where the OpenAI-compatible API listens, and its bounds. TLS is the fronted
    service's own (`RouterConfig.tls`)."""

    host: str = "127.0.0.1"
    port: int = 0
    """0 = any free port (the bound one is reported)."""
    model_name: str | None = None
    """The model id clients name (`GET /v1/models`); None: the model folder's name."""
    max_body_bytes: int = 8 << 20
    """Largest request body: a longer one is 413 before it is read."""
    max_header_bytes: int = 16 << 10
    """Largest request line and headers."""
    header_timeout_s: float = 10.0
    """A connection must send a whole request head within this (else it is closed): slow
    clients cannot hold connections."""
    body_timeout_s: float = 30.0
    """A request's body must arrive within this after its head (else 408)."""
    keep_alive_s: int = 5
    """An idle kept-alive connection is closed after this."""
    max_connections: int = 512
    """Connections served at once: a request that finds more open, or more requests
    running, gets 503 (OpenAI's error object) and its connection is closed."""
    request_timeout_s: float = 3600.0
    """A generation's deadline (its Decoder call's)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port: must be in [0, 65536)")
        for name in ("max_body_bytes", "max_header_bytes", "max_connections", "keep_alive_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        for name in ("header_timeout_s", "body_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0")
