"""What every part of the shard's `PrefixStore` service shares (`Service`): the shard, its
metadata and config, the gate every call comes in by (`rpc.handler`: authenticated from its
metadata alone, then a call slot, then its request read), and the helpers the parts use on
a call (its caller and namespace, size checks).

The service's methods are served by its parts, one noun each: `chunks` (Lookup, Put, OpenPut,
Fetch, OpenFetch, Delete), `artifacts` (PutArtifact, FetchArtifact, OpenPutArtifact,
OpenFetchArtifact), `attend` (Attend) and
`admin` (Describe, Stats); `app` builds the server. Every request arrives as raw bytes: its
size is checked before it is parsed (a malformed one is INVALID_ARGUMENT naming its
message), and client streams' messages are parsed as they are read. Store errors map to
status codes through `rpc.status.STORE` (never UNKNOWN); anything unexpected is INTERNAL with
only a request id, logged with its traceback under that id.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.auth import Authenticator, QuotaGuard, namespace_of
from prefix_store.config import ShardConfig
from prefix_store.data_plane import DataPlane
from prefix_store.errors import InvalidArgument, PermissionDenied
from prefix_store.metadata import Metadata
from prefix_store.metadata.records import Tenant
from prefix_store.pace import Pacer
from prefix_store.protocol.frames import token_key
from prefix_store.server.attend import AttendStats, kernel_fingerprint
from prefix_store.server.requests import REQUESTS, SMALL_REQUEST, SMALL_REQUESTS, STREAMS
from prefix_store.shard import Shard
from prefix_store.shard_metrics import ShardMetrics
from prefix_store.shares import FairShare
from rpc.handler import Call, Gate
from rpc.limits import CallLimits, IdleStreams
from rpc.server import parse, peer_host
from rpc.status import STORE


class Service:
    """The service's shared state and the gate its calls come in by (one per shard)."""

    def __init__(
        self,
        shard: Shard,
        metadata: Metadata,
        config: ShardConfig,
        data_plane: DataPlane | None = None,
        data_address: str = "",
    ) -> None:
        self.shard = shard
        self.data_plane = data_plane
        self.data_address = data_address
        self.metadata = metadata
        self.config = config
        self.auth = Authenticator(metadata, config.auth)
        self.quota = QuotaGuard(metadata, config.shard_id)
        self.limits = CallLimits(config.calls)
        self.idle = IdleStreams(config.calls.stream_idle_s)
        self.pacer = Pacer()
        """Cuts put streams past their deadline or below their minimum rate (`pace`)."""
        self.pinned = FairShare(
            max(1, config.memory_bytes + config.disk_bytes),
            "bytes pinned by data-plane fetch tickets",
        )
        """What data-plane fetch tickets pin until redeemed or expired (chunks they lease,
        artifacts whose bytes they hold), shared by tenant: one tenant's tickets cannot pin
        the whole store."""
        self.kernel = kernel_fingerprint(config.attention)
        """The attention kernel this shard serves Attend with ("" = none)."""
        self.attend_stats = AttendStats()
        self.metrics = ShardMetrics(self, config.metrics.tenant_labels if config.metrics else 32)
        self.gate = Gate(
            "PrefixStore", self.metrics.rpc, STORE, self.authenticate, self.admit, self.request
        )

    def check_size(self, name: str, nbytes: int, limit: int | None = None) -> None:
        """InvalidArgument naming `name` when a message of `nbytes` exceeds `limit` (default:
        `max_message_bytes`)."""
        limit = self.config.max_message_bytes if limit is None else limit
        if nbytes > limit:
            raise InvalidArgument(
                f"{name}: a message of {nbytes} bytes exceeds the limit of {limit} bytes"
            )

    def request_limit(self, method: str) -> int:
        """The largest request `method` (one with a single request, or a Put header) takes."""
        if method in SMALL_REQUESTS:
            return SMALL_REQUEST
        return min(self.config.max_request_bytes, self.config.max_message_bytes)

    def admit(self, tenant: Tenant):
        """One of `tenant`'s call slots: its fair share, weighted, or the admin pool."""
        return self.limits.admit(tenant.name, tenant.weight, tenant.admin)

    def authenticate(self, token: str, peer: str) -> AbstractContextManager[Tenant]:
        """The caller's tenant, from its token alone: no request byte is read first."""
        return nullcontext(self.auth.tenant(token, peer))

    def request(self, method: str, raw, call: Call):
        """`method`'s request parsed from `raw`; a client stream's messages parsed as read
        (and the call cancelled when its next message is overdue)."""
        if method in STREAMS:
            raw = self.idle.watch(call.context, iter(raw))
            return self._messages(STREAMS[method], raw) if STREAMS[method] else raw
        self.check_size(REQUESTS[method].__name__, len(raw), self.request_limit(method))
        return parse(REQUESTS[method], raw)

    def _messages(self, message_class, raws):
        for raw in raws:
            self.check_size(message_class.__name__, len(raw))
            message = parse(message_class, raw)
            del raw
            yield message
            del message  # neither is kept while the next one is awaited

    def caller(self, call: Call, namespace: str | None = None):
        """The caller's tenant, and `namespace` as it may use it (None when not named)."""
        tenant = call.caller
        return tenant, (namespace_of(tenant, namespace) if namespace is not None else None)

    @staticmethod
    def owner_key(call: Call) -> bytes:
        """What binds a data-plane ticket to the caller's tenant (see `redemption`)."""
        return token_key(call.token)

    def ticket(
        self, call: Call, run, close, nbytes: int, signature: bytes = b""
    ) -> pb.TransferTicket:
        """A data-plane ticket for the caller's transfer of `nbytes`: `run(conn)` once it
        is redeemed, `close()` exactly when it ends (run, expired, or not issued: then at
        once, and the error raised)."""
        try:
            ticket = self.data_plane.issue(
                run,
                close,
                peer_host(call.peer()),
                nbytes,
                self.owner_key(call),
                call.caller.name,
                call.caller.weight,
            )
        except BaseException:
            close()
            raise
        return pb.TransferTicket(
            ticket=ticket,
            data_address=self.data_address,
            total_bytes=nbytes,
            expires_ms=int(self.data_plane.ticket_ttl_s * 1000),
            signature=signature,
        )

    def writer(self, call: Call, namespace: str):
        """The caller and `namespace`, which its role must let it write."""
        tenant, space = self.caller(call, namespace)
        if not space.writable:
            raise PermissionDenied(
                f"namespace {namespace!r}: tenant {tenant.name!r} may read it, not write it"
            )
        return tenant, space

    def message_bytes(self, requested: int) -> int:
        """The size of a response stream's messages: the caller's, within the shard's bounds."""
        if requested == 0:
            return self.config.message_bytes
        if not 64 * 1024 <= requested <= self.config.max_message_bytes:
            raise InvalidArgument(
                f"max_message_bytes: {requested} is not in [65536, {self.config.max_message_bytes}]"
            )
        return requested

    def shard_stats(self) -> dict:
        """Shard-wide figures, for the membership heartbeat (operators)."""
        counts = self.shard.counts()
        held, charged = self.shard.accounting()
        stats = self.shard.stats
        return {
            "shard_id": self.config.shard_id,
            "memory_bytes": self.shard.memory.used,
            "memory_capacity": self.shard.memory.capacity,
            "disk_bytes": self.shard.disk.used,
            "disk_capacity": self.shard.disk.capacity,
            "chunks": counts["chunks"],
            "artifacts": counts["artifacts"],
            "lookup_hits": stats.hits,
            "lookup_misses": stats.misses,
            "fetched_bytes": stats.fetched_bytes,
            "received_bytes": stats.received_bytes,
            "stored_bytes": stats.stored_bytes,
            "evictions": stats.evictions,
            "dropped": stats.dropped,
            "memory_blobs": len(self.shard.memory),
            "leased_chunks": counts["leased"],
            # Faults survived: blobs that failed their checksum, evicted blobs lost to a
            # failed disk write, disk write errors, unusable files dropped at start-up.
            "corrupt": stats.corrupt,
            "scrub_corrupt": stats.scrub_corrupt,
            "scrubbed_bytes": stats.scrubbed_bytes,
            "lost_spills": stats.lost_spills,
            "disk_write_errors": self.shard.disk.write_errors,
            "disk_rejected": len(self.shard.disk.rejected),
            "held_bytes": held,
            "usage_bytes": charged,
            **self.attend_stats.figures(),
        }
