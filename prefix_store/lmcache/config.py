"""The gateway's one typed config."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefix_store.config import ClientConfig, MiB
from prefix_store.metrics import MetricsConfig
from prefix_store.tls import TLSClientConfig

MAX_WIRE_LENGTH = (1 << 31) - 1
"""A frame's length is an int32 on LMCache's wire."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """An LMCache gateway: where it listens, the store and tenant it acts for, its limits.

    LMCache's protocol carries no credentials: every connection acts as the configured
    tenant, so the gateway is a trust boundary and binds loopback unless told otherwise."""

    endpoints: tuple[str, ...]
    """Store shard addresses (host:port) to start from; the membership is followed."""
    token: str = field(repr=False)
    """Bearer token of the tenant the gateway acts as (never logged or shown)."""
    namespace: str = ""
    """Namespace the objects live in: "" = the tenant's private one, else a shared one in
    which the tenant is a writer."""
    host: str = "127.0.0.1"
    """Address to bind; anything but loopback exposes the tenant to whoever reaches it."""
    port: int = 0
    """0 picks a free port."""
    tls: TLSClientConfig | None = None
    """How to reach TLS shards (None: in the clear)."""
    allowed_uids: tuple[int, ...] = ()
    """Local users, besides the gateway's own (`os.getuid()`), whose processes may connect.
    Every accepted connection's peer is looked up (`peers.peer_uid`: /proc/net/tcp{,6});
    one of another user, or not on this host, is closed at once and counted."""
    max_connections: int = 8
    """Open LMCache connections; a further one is closed at once."""
    max_object_bytes: int = 256 * MiB
    """Largest PUT payload; a larger declared length closes the connection. A payload is
    read into its final buffer, whose pages are backed only as its bytes arrive
    (`objects.Envelope.buffer`): memory grows with what arrived, not the declared length."""
    io_timeout_s: float = 30.0
    """A frame whose bytes stall this long (mid-header, mid-payload, a reply not taken)
    closes its connection."""
    idle_timeout_s: float = 300.0
    """A connection with no frame for this long is closed (LMCache's connector does not
    reconnect: keep it above the engine's longest quiet spell)."""
    stop_grace_s: float = 2.0
    """On stop, requests in progress get this long to finish."""
    metrics: MetricsConfig | None = None
    """Serve Prometheus metrics on their own port (`prefix_store.lmcache.metrics`)."""

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str) or not self.endpoints:
            raise ValueError("endpoints: give at least one store address (a tuple of host:port)")
        if not self.token:
            raise ValueError("token: required (the tenant the gateway acts as)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not in [0, 65535]")
        if any(uid < 0 for uid in self.allowed_uids):
            raise ValueError(f"allowed_uids: {self.allowed_uids} holds a negative uid")
        if self.max_connections < 1:
            raise ValueError(f"max_connections: {self.max_connections} is not >= 1")
        if not 1 <= self.max_object_bytes <= MAX_WIRE_LENGTH:
            raise ValueError(
                f"max_object_bytes: {self.max_object_bytes} is not in [1, {MAX_WIRE_LENGTH}]"
            )
        if self.io_timeout_s <= 0 or self.idle_timeout_s <= 0 or self.stop_grace_s < 0:
            raise ValueError("io_timeout_s and idle_timeout_s must be > 0, stop_grace_s >= 0")

    def client_config(self) -> ClientConfig:
        """How the gateway's store client connects."""
        return ClientConfig(tls=self.tls)
