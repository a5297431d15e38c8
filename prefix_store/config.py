"""One typed config per component of the store: shard, server, metadata plane, client."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prefix_store.layout import LayoutBounds
from prefix_store.limits import CallBounds
from prefix_store.metrics import MetricsConfig
from prefix_store.pace import PutBounds
from prefix_store.throttle import AuthBounds
from prefix_store.tls import TLSClientConfig, TLSConfig

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class DataPlaneLimits:
    """What one data plane holds at most, so that no client can exhaust it."""

    ticket_ttl_s: float = 30.0
    """An unredeemed ticket expires (releasing its leases) after this long."""
    max_tickets: int = 1024
    """Outstanding tickets, shared by the tenants holding them (`prefix_store.shares`: a
    tenant alone gets half, weighted, a newcomer always finds room); beyond its share
    `issue` raises LimitExceeded (RESOURCE_EXHAUSTED, retry-after-ms)."""
    max_connections: int = 256
    """Connections moving a tenant's transfer (ticket redeemed), shared by tenant as
    `max_tickets`; one beyond its tenant's share is told RESOURCE_EXHAUSTED and closed."""
    max_opening: int = 64
    """Connections that have not yet redeemed a ticket (unauthenticated), shared by peer
    address; beyond a peer's share (or `opening_per_peer`) a new one takes over the slot of
    that peer's oldest connection still opening, which is cut (so idle connections cannot
    lock out a client at the same address: it redeems at once); a peer holding none is
    told RESOURCE_EXHAUSTED and closed."""
    opening_per_peer: int = 16
    """Connections one peer address may hold before redeeming their tickets."""
    handshake_s: float = 5.0
    """A new connection must finish its TLS handshake and send its ticket within this long,
    or it is cut: unauthenticated peers hold no connection longer."""
    idle_s: float = 15.0
    """A connection that moves no byte for this long is closed (ticket read included)."""
    deadline_s: float = 60.0
    """Every transfer may take this long, or longer at `min_rate` for a large one..."""
    min_rate: float = 8 * 1024 * 1024
    """...bytes per second: a slower transfer is cut (the client fails over or retries)."""

    def deadline(self, nbytes: int) -> float:
        return max(self.deadline_s, nbytes / self.min_rate)

    def __post_init__(self) -> None:
        if min(self.max_tickets, self.max_connections, self.max_opening) < 1:
            raise ValueError("DataPlaneLimits: max_tickets, max_connections, max_opening >= 1")
        if self.opening_per_peer < 1 or self.handshake_s <= 0:
            raise ValueError("DataPlaneLimits: opening_per_peer >= 1 and handshake_s > 0")


@dataclass(frozen=True, slots=True)
class ShardConfig:
    """A shard: its tiers and its gRPC server."""

    shard_id: str = "shard-0"
    """Stable name; a restarted shard with the same id and disk_dir finds its disk tier."""
    memory_bytes: int = 4 * GiB
    """Capacity of the memory tier (LRU)."""
    disk_bytes: int = 0
    """Capacity of the disk tier; 0 disables spilling (evicted chunks are dropped)."""
    disk_dir: Path | None = None
    """Where the disk tier keeps its files (required when disk_bytes > 0)."""
    host: str = "127.0.0.1"
    """Address the gRPC server binds (0.0.0.0 on a cluster) and advertises."""
    advertise_host: str | None = None
    """Host clients should dial, when it differs from `host` (e.g. the node IP)."""
    port: int = 0
    """0 picks a free port."""
    data_port: int | None = 0
    """Port of the bulk data plane (0 = a free one, None = no data plane: gRPC only)."""
    message_bytes: int = 4 * MiB
    """Target size of one Fetch message (segments are batched up to it)."""
    max_message_bytes: int = 64 * MiB
    """Largest gRPC message accepted or sent (Put segment batches, PutArtifact data); the
    transport refuses anything over it plus `REQUEST_SLACK` before a handler runs."""
    max_request_bytes: int = 8 * MiB
    """Largest request of a unary method (Lookup, Delete, OpenPut, OpenFetch...) and largest
    Put header (at most `max_message_bytes`): refused INVALID_ARGUMENT before it is parsed.
    Describe, Stats and FetchArtifact requests are bounded lower (`server.SMALL_REQUEST`)."""
    max_tokens: int = 1 << 20
    """Token ids in one request (Lookup, Delete, a Put header): checked before they are
    read into a list."""
    max_put_bytes: int = 4 * GiB
    """Largest single Put or PutArtifact stream."""
    receive_bytes: int = 8 * GiB
    """Bytes of puts being received at once (all callers), buffered until their commit.
    Only bytes that arrived are held, within each tenant's fair share of this
    (`prefix_store.shares`: a tenant alone may hold half); a put beyond its tenant's share is
    refused (RESOURCE_EXHAUSTED), at its header when its declared size already is."""
    puts: PutBounds = field(default_factory=PutBounds)
    """Absolute deadline and minimum rate of every put stream (`prefix_store.pace`)."""
    layouts: LayoutBounds = field(default_factory=LayoutBounds)
    """Per-dimension limits of the layouts this shard stores and looks up."""
    scrub_rate: float = 16 * MiB
    """Bytes per second the background scrubber re-reads at rest (both tiers) to check
    their CRC-32C (`prefix_store.scrub`); a corrupt blob is dropped as a corrupt read
    drops it. 0: no scrubber."""
    workers: int = 32
    """gRPC server threads (concurrent RPCs)."""
    calls: CallBounds = field(default_factory=CallBounds)
    """Concurrent calls per tenant and in all (below `workers`), idle client streams."""
    auth: AuthBounds = field(default_factory=AuthBounds)
    """The token cache, and how many unknown tokens a peer may try (`throttle`)."""
    attention: bool = True
    """Serve Attend (near-data attention) with this process's fused attention kernel when it
    has one; False: advertise no kernel and refuse Attend (FAILED_PRECONDITION)."""
    max_attend_streams_per_tenant: int = 8
    """Concurrent Attend streams of one tenant (each also holds one of its `calls`)."""
    grace_s: float = 2.0
    """Graceful shutdown: in-flight RPCs get this long to finish."""
    heartbeat_s: float = 1.0
    """Membership heartbeat period; the registration lives for `ttl_s`."""
    ttl_s: float = 5.0
    data_limits: DataPlaneLimits = field(default_factory=DataPlaneLimits)
    """Bounds of the data plane (tickets, connections, idle time, transfer deadlines)."""
    provenance_key: bytes = b""
    """The deployment's provenance public key (32 bytes, see `prefix_store.provenance`):
    signatures of puts are checked with it, and a put whose signature fails is refused.
    Empty: signatures are kept unchecked (decoders still check them) and no put counts as
    signed, so none replaces a stored chunk."""
    tls: TLSConfig | None = None
    """Serve gRPC and the data plane over TLS (mTLS when it has a client CA); None: in the
    clear. PEM bytes, so that a shard actor on another host needs no certificate file."""
    metrics: MetricsConfig | None = None
    """Serve Prometheus metrics on their own port (`prefix_store.metrics`); None: none."""

    def __post_init__(self) -> None:
        if self.receive_bytes < self.max_put_bytes:
            raise ValueError("receive_bytes must be >= max_put_bytes (or no such put fits)")
        if self.max_request_bytes < 64 * 1024:
            raise ValueError("max_request_bytes must be >= 64 KiB")
        if self.max_tokens < 1 or self.scrub_rate < 0:
            raise ValueError("max_tokens must be >= 1 and scrub_rate >= 0")
        if self.calls.total + self.calls.reserved >= self.workers:
            raise ValueError(
                "calls.total + calls.reserved must be below workers (threads for health checks)"
            )
        if self.provenance_key and len(self.provenance_key) != 32:
            raise ValueError("provenance_key: a 32-byte Ed25519 public key, or empty")
        if self.memory_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("memory_bytes and disk_bytes must be >= 0")
        if self.disk_bytes > 0 and self.disk_dir is None:
            raise ValueError("disk_dir is required when disk_bytes > 0")
        if not 64 * 1024 <= self.message_bytes <= self.max_message_bytes:
            raise ValueError("message_bytes must be in [64 KiB, max_message_bytes]")
        if self.ttl_s <= self.heartbeat_s:
            raise ValueError("ttl_s must exceed heartbeat_s")
        if self.max_attend_streams_per_tenant < 1:
            raise ValueError("max_attend_streams_per_tenant must be >= 1")

    @property
    def advertised(self) -> str:
        return self.advertise_host or self.host


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """The client SDK: deadlines, retries, transfer tuning."""

    timeout_s: float = 30.0
    """Deadline of every unary call."""
    stream_timeout_s: float = 300.0
    """Deadline of every streaming call (Put, Fetch)."""
    retries: int = 4
    """Attempts per call on UNAVAILABLE, across replicas, before giving up."""
    backoff_s: float = 0.05
    """First backoff; doubles per attempt up to `max_backoff_s`."""
    max_backoff_s: float = 1.0
    message_bytes: int = 4 * MiB
    """Target size of Put messages and of requested Fetch messages."""
    max_message_bytes: int = 64 * MiB
    streams: int = 2
    """Parallel bulk streams per transfer, spread over the shards involved (at least one per
    shard; a shard gets several when there are fewer shards than streams). More streams than
    cores only add contention."""
    window_bytes: int = 16 * MiB
    """HTTP/2 flow-control window per stream and connection (larger = fewer stalls)."""
    data_plane: bool = True
    """Fetch over the shards' bulk data plane (OpenFetch) when they offer one; False
    streams through gRPC Fetch messages."""
    idle_timeout_s: float = 10.0
    """A connection with nothing moving for this long counts as lost (a dead link or host
    drops packets without resetting anything): data-plane sockets time out, gRPC keepalive
    pings go unanswered, an Attend query waits no longer for its answer (a hung shard would
    otherwise hold a decoder's whole pass), and the transfer or query continues on a
    replica."""
    quarantine_s: float = 30.0
    """After a shard failed, transfers and calls prefer its replicas for this long."""
    refresh_s: float = 10.0
    """Re-read the shard membership (Describe) this often, checked at each call; a shard
    that failed (unreachable) makes it due sooner, after `min_refresh_s`."""
    min_refresh_s: float = 1.0
    """Soonest a failure makes the next membership refresh due after the last one."""
    membership_grace_s: float = 10.0
    """How long a shard must be listed before new chunks are placed on it, and unlisted
    before its chunks are placed elsewhere (meanwhile calls route around it): a flapping
    shard moves no chunk (see `prefix_store.client.membership`)."""
    tls: TLSClientConfig | None = None
    """Connect to the shards (gRPC and data plane) over TLS, verifying their certificates
    (and presenting a client certificate to mTLS shards); None: in the clear."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.stream_timeout_s <= 0 or self.idle_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.quarantine_s < 0 or self.membership_grace_s < 0:
            raise ValueError("quarantine_s and membership_grace_s must be >= 0")
        if self.refresh_s <= 0 or self.min_refresh_s <= 0:
            raise ValueError("refresh_s and min_refresh_s must be > 0")
        if self.retries < 1:
            raise ValueError("retries must be >= 1")
        if self.streams < 1:
            raise ValueError("streams must be >= 1")
