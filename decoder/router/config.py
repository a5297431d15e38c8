"""The router's typed configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from decoder.http.config import HttpConfig
from decoder.router.policies import POLICIES
from prefix_store.config import ClientConfig
from prefix_store.limits import CallBounds
from prefix_store.metrics import MetricsConfig
from prefix_store.tls import TLSClientConfig, TLSConfig


@dataclass(frozen=True)
class RouterConfig:
    """One router: where the store is (to authenticate callers), how it listens, how it
    chooses and watches decoders."""

    store_endpoints: tuple[str, ...]
    """host:port of one or more shards: callers' tokens are checked against the store."""
    decoders: tuple[str, ...] = ()
    """host:port of the decoders at start; later changes come through
    `RouterServer.set_decoders`."""
    host: str = "127.0.0.1"
    port: int = 0
    """gRPC port (0 = any free port; the bound one is reported)."""
    advertise_host: str | None = None
    router_id: str = "router-0"
    model: str | None = None
    """The decoders' model folder (None: the built-in model): only its tokenizer is loaded,
    to route text prompts."""
    policy: str = "affinity"
    """How a request's decoder is chosen (`decoder.router.policies`): "affinity" (prefix
    affinity with bounded loads) or "round-robin" (each request to the next live decoder:
    the baseline it is measured against)."""
    affinity_chunks: int = 2
    """Full 256-token chunks of a prompt that make its routing identity."""
    load_factor: float = 1.25
    """Bounded loads: no decoder takes a request while it holds load_factor times the
    average (rounded up)."""
    max_attempts: int = 3
    """Decoders one request may be tried on (first attempt included)."""
    poll_s: float = 0.5
    """How often decoders' health and load (their Info) are read."""
    down_after: int = 2
    """Consecutive failed health checks after which a decoder is out (its streams move)."""
    silence_s: float = 60.0
    """A decoder that sent a request's first tokens and then nothing for this long is taken
    as hung: the stream moves to another decoder."""
    internal_token_file: Path | None = None
    """The deployment's internal credential (0600, `decoder.internal`), read on the
    router's own host at start: with it the router reads each decoder's load from its Info
    (`vericache serve` names `<state dir>/internal.token`). None: no Info, so loads are
    this router's own in-flight counts (a warning at start); a file named but missing or
    readable by others stops the router from starting."""
    decoder_tls: TLSClientConfig | None = None
    """TLS to the decoders (None: in the clear)."""
    client: ClientConfig = field(default_factory=ClientConfig)
    """How the router's store clients connect (authentication)."""
    tls: TLSConfig | None = None
    """Serve gRPC over TLS (mTLS when it has a client CA); None: in the clear."""
    metrics: MetricsConfig | None = None
    http: HttpConfig | None = None
    """Serve the OpenAI-compatible HTTP API (`decoder.http`) too; None: gRPC only."""
    max_workers: int = 64
    calls: CallBounds = field(default_factory=lambda: CallBounds(per_tenant=16, total=48))
    store_clients: int = 64
    auth_recheck_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.store_endpoints:
            raise ValueError("store_endpoints: at least one host:port is required")
        if any(not isinstance(d, str) for d in self.decoders):
            raise ValueError("decoders: host:port strings")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.affinity_chunks < 1:
            raise ValueError("affinity_chunks must be >= 1")
        if self.load_factor < 1:
            raise ValueError("load_factor must be >= 1")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.calls.total + self.calls.reserved >= self.max_workers:
            raise ValueError("calls.total + calls.reserved must be below max_workers")
