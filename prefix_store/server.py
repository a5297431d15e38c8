"""The shard's gRPC server: the `vericache.v1.PrefixStore` service over one `Shard`.

`ShardServer` bundles the shard, its server (with health checking and reflection) and the
membership heartbeat. Every method takes its request as raw bytes and authenticates the
caller from the call's metadata before it reads them: a caller without a known token gets
UNAUTHENTICATED whatever it sends, and only then is the request parsed (a malformed one is
INVALID_ARGUMENT naming its message) and its namespace resolved. Store errors map to
status codes through `status.code_of` (never UNKNOWN); anything unexpected is INTERNAL with
only a request id, logged with its traceback under that id (`status.abort`).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from contextlib import AbstractContextManager, nullcontext

import grpc
import numpy as np
from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from prefix_store import attend, faults
from prefix_store.auth import Authenticator, QuotaGuard, namespace_of
from prefix_store.blob import crc32c
from prefix_store.config import ShardConfig
from prefix_store.data_plane import DataPlane, head_major, send_frames
from prefix_store.errors import Aborted, InvalidArgument, PermissionDenied
from prefix_store.layout import KVLayout
from prefix_store.limits import CallLimits, IdleStreams, TenantSlots
from prefix_store.metadata import Metadata, Tenant
from prefix_store.metrics import metrics_endpoint
from prefix_store.namespace import OWNER
from prefix_store.pace import Pace, Pacer, PutBounds
from prefix_store.protocol import wire
from prefix_store.protocol.frames import (
    COMMIT,
    DONE,
    HEADER,
    OK,
    read_frame_header,
    recv_exact,
    token_key,
)
from prefix_store.provenance import Proof
from prefix_store.scrub import Scrubber
from prefix_store.shard import ChunkRef, Deletable, Reservation, Shard
from prefix_store.shard_metrics import ShardMetrics
from prefix_store.shares import FairShare
from prefix_store.tls import server_context
from rpc.handler import Call, Gate, serialize, streaming, unary
from rpc.server import client_stream, grpc_server, parse, peer_host
from rpc.status import STORE

log = logging.getLogger(__name__)
SERVICE = "vericache.v1.PrefixStore"
MAX_CHUNKS_PER_FETCH = 1 << 16
MAX_SPEC = 256
REQUEST_SLACK = 1 << 20
"""The transport accepts messages up to `max_message_bytes` plus this, so that one a little
over the limit gets INVALID_ARGUMENT naming it; beyond, gRPC answers RESOURCE_EXHAUSTED
before any handler runs."""
SMALL_REQUEST = 64 * 1024
"""Largest request of Describe, Stats and FetchArtifact (they carry a few names)."""
SMALL_REQUESTS = frozenset({"Describe", "Stats", "FetchArtifact"})


REQUESTS = {
    "Describe": pb.DescribeRequest,
    "Lookup": pb.LookupRequest,
    "Delete": pb.DeleteRequest,
    "OpenFetch": pb.FetchRequest,
    "OpenPut": pb.PutHeader,
    "Stats": pb.StatsRequest,
    "Fetch": pb.FetchRequest,
    "FetchArtifact": pb.FetchArtifactRequest,
}
"""The request message of each method with one request; `handlers` passes them raw."""
STREAMS = {"Put": None, "PutArtifact": pb.PutArtifactRequest, "Attend": pb.AttendRequest}
"""The message of each client stream; None: the handler parses the raw bytes (Put: `wire`)."""


def once(*actions):
    """A callable that runs `actions` in order the first time it is called, never again."""
    lock, done = threading.Lock(), []

    def run() -> None:
        with lock:
            if done:
                return
            done.append(True)
        run_all(actions)

    return run


def run_all(actions) -> None:
    """Each of `actions` in order, the later ones even when an earlier one raised."""
    if actions:
        try:
            actions[0]()
        finally:
            run_all(actions[1:])


def proof_message(proof: Proof) -> pb.ChunkProof:
    return pb.ChunkProof(digest=proof.digest, signature=proof.signature)


def layout_of(message) -> KVLayout:
    if not message.HasField("layout"):
        raise InvalidArgument("layout: required")
    return KVLayout.from_proto(message.layout)


class PrefixStoreServicer(pb_grpc.PrefixStoreServicer):
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
        self.kernel = attend.kernel_fingerprint(config.attention)
        """The attention kernel this shard serves Attend with ("" = none)."""
        self.attend_slots = TenantSlots(config.max_attend_streams_per_tenant, "Attend streams")
        self.leases = FairShare(
            max(1, config.memory_bytes + config.disk_bytes), "bytes of chunks leased by tickets"
        )
        """What data-plane tickets pin (their chunks cannot be evicted until redeemed or
        expired), shared by tenant: one tenant's tickets cannot pin the whole store."""
        self.attend_stats = attend.AttendStats()
        self.metrics = ShardMetrics(self, config.metrics.tenant_labels if config.metrics else 32)
        self.gate = Gate(
            "PrefixStore", self.metrics.rpc, STORE, self.authenticate, self.admit, self.request
        )

    def check_size(self, name: str, nbytes: int, limit: int | None = None) -> None:
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

    def _caller(self, call: Call, namespace: str | None = None):
        tenant = call.caller
        return tenant, (namespace_of(tenant, namespace) if namespace is not None else None)

    @staticmethod
    def _owner_key(call: Call) -> bytes:
        """What binds a data-plane ticket to the caller's tenant (see `redemption`)."""
        return token_key(call.token)

    def _writer(self, call: Call, namespace: str):
        """The caller and `namespace`, which its role must let it write."""
        tenant, space = self._caller(call, namespace)
        if not space.writable:
            raise PermissionDenied(
                f"namespace {namespace!r}: tenant {tenant.name!r} may read it, not write it"
            )
        return tenant, space

    @unary
    def Describe(self, request, call):
        tenant, _ = self._caller(call)
        shards = self.metadata.shards()
        replication = self.metadata.replication() or min(2, max(1, len(shards)))
        return pb.DescribeResponse(
            tenant=tenant.name,
            namespaces=[
                pb.NamespaceInfo(name=n.name, salt=n.salt) for n in tenant.namespaces.values()
            ],
            shards=[
                pb.ShardInfo(
                    shard_id=s.shard_id,
                    address=s.address,
                    data_address=s.info.get("data_address", ""),
                    attention_kernel=s.info.get("attention_kernel", ""),
                )
                for s in shards
            ],
            replication=min(replication, max(1, len(shards))),
            max_message_bytes=self.config.max_message_bytes,
            weight=tenant.weight,
            admin=tenant.admin,
        )

    @unary
    def Lookup(self, request, call):
        tenant, space = self._caller(call, request.namespace)
        result = self.shard.lookup(
            space, layout_of(request), request.token_ids, request.chunk_indices
        )
        asked = len(set(request.chunk_indices)) if request.chunk_indices else len(result.keys)
        self.metrics.looked_up(tenant.name, len(result.present), asked - len(result.present))
        return pb.LookupResponse(
            chunk_keys=result.keys,
            present=result.present,
            partial_index=result.partial_index,
            partial_tokens=result.partial_tokens,
            partial_key=result.partial_key,
            cached_tokens=result.cached_tokens,
            proofs=[proof_message(p) for p in result.proofs],
            partial_proof=proof_message(result.partial_proof),
        )

    @unary
    def Put(self, request_iterator, call):
        """Requests arrive serialised (see `wire`): each segment is parsed as a view of its
        message and copied into the put's own buffers (the message is not kept). The bytes
        that arrived stay reserved until the put commits or ends (`PutSession.close`); the
        stream keeps to its deadline and minimum rate (`pace`)."""
        pace = Pace(self.config.puts, 0)
        with self.pacer.watch(call, pace):
            return self._put(client_stream(request_iterator), call, pace)

    def _put(self, messages, call, pace: Pace):
        session = None
        try:
            for raw in messages:
                self.check_size("PutRequest", len(raw))
                if session is None:
                    session = self._put_header(raw, call, pace)
                else:
                    done = self._put_part(session, raw, pace)
                    if done is not None:
                        return done
                del raw  # nothing of a message is kept while the next one is awaited
            raise Aborted("put: the stream ended before its commit; nothing was stored")
        finally:
            if session is not None:
                session.close()

    def _put_header(self, raw, call, pace: Pace):
        part, value = wire.decode_put(raw)
        if part != "header":
            raise InvalidArgument("put: the first message must be a header")
        self.check_size("PutHeader", len(value), self.request_limit("OpenPut"))
        session = self._begin_put(parse(pb.PutHeader, value), call)
        pace.declare(session.total_bytes)
        return session

    @staticmethod
    def _put_part(session, raw, pace: Pace) -> pb.PutResponse | None:
        """A message after the header: segments (copied into the session), or the commit
        (its response)."""
        part, value = wire.decode_put(raw)
        if part == "segments":
            for layer, chunk, data, _ in value:
                session.add(layer, chunk, data)
            pace.arrived(sum(len(data) for _, _, data, _ in value))
            return None
        if part == "commit":
            done = session.commit(list(parse(pb.PutCommit, value).crc32c))
            return pb.PutResponse(
                chunk_keys=done.keys, stored_bytes=done.new_bytes, new_keys=done.new_keys
            )
        raise InvalidArgument(f"put: unexpected {part or 'empty'} message after header")

    def _begin_put(self, header, call):
        tenant, space = self._writer(call, header.namespace)
        return self.shard.begin_put(
            space,
            layout_of(header),
            header.token_ids,
            header.chunk_indices,
            tenant.name,
            self.quota,
            header.signatures,
            getattr(tenant, "weight", None),
        )

    def _fetch_args(self, request, call):
        _, space = self._caller(call, request.namespace)
        layout = layout_of(request)
        if not 0 < len(request.chunks) <= MAX_CHUNKS_PER_FETCH:
            raise InvalidArgument(f"chunks: between 1 and {MAX_CHUNKS_PER_FETCH} required")
        end = request.layer_end or layout.num_layers
        refs = [ChunkRef(c.key, c.tokens, c.digest) for c in request.chunks]
        return space, layout, refs, request.layer_start, end

    @unary
    def OpenFetch(self, request, call):
        if self.data_plane is None:
            raise InvalidArgument("OpenFetch: this shard has no data plane; use Fetch")
        space, layout, refs, start, end = self._fetch_args(request, call)
        tenant = call.caller
        leased = sum(layout.segment_bytes(ref.tokens) for ref in refs) * layout.num_layers
        self.leases.acquire(tenant.name, leased, tenant.weight)
        try:
            stream = self.shard.open_fetch(space, layout, refs, start, end)
        except BaseException:
            self.leases.release(tenant.name, leased)
            raise
        close = once(stream.close, lambda: self.leases.release(tenant.name, leased))
        tokens = [ref.tokens for ref in refs]
        row_bytes = layout.head_dim * layout.itemsize
        frames = (
            (layer, crcs, head_major(segments, tokens, layout.num_kv_heads, row_bytes))
            for layer, segments, crcs in stream.layers()
        )
        try:
            ticket = self.data_plane.issue(
                lambda conn: send_frames(conn, frames),
                close,
                peer_host(call.peer()),
                stream.total_bytes,
                self._owner_key(call),
                tenant.name,
                tenant.weight,
            )
        except BaseException:
            close()
            raise
        return pb.TransferTicket(
            ticket=ticket,
            data_address=self.data_address,
            total_bytes=stream.total_bytes,
            expires_ms=int(self.data_plane.ticket_ttl_s * 1000),
        )

    @unary
    def OpenPut(self, request, call):
        if self.data_plane is None:
            raise InvalidArgument("OpenPut: this shard has no data plane; use Put")
        session = self._begin_put(request, call)
        total = session.layer_bytes * session.layout.num_layers
        try:
            ticket = self.data_plane.issue(
                lambda conn: receive_put(conn, session, self.config.puts),
                session.close,
                peer_host(call.peer()),
                total,
                self._owner_key(call),
                call.caller.name,
                call.caller.weight,
            )
        except BaseException:
            session.close()
            raise
        return pb.TransferTicket(
            ticket=ticket,
            data_address=self.data_address,
            total_bytes=total,
            expires_ms=int(self.data_plane.ticket_ttl_s * 1000),
        )

    @streaming
    def Fetch(self, request, call):
        space, layout, refs, start, end = self._fetch_args(request, call)
        message_bytes = self._message_bytes(request.max_message_bytes)
        for batch in self.shard.fetch(space, layout, refs, start, end, message_bytes):
            # Serialised here (see `wire`): one copy of the stored bytes into the message.
            yield wire.fetch_response(
                [(lyr, c, faults.TRANSIT.tamper([d]), crc) for lyr, c, d, crc in batch]
            )

    def _message_bytes(self, requested: int) -> int:
        if requested == 0:
            return self.config.message_bytes
        if not 64 * 1024 <= requested <= self.config.max_message_bytes:
            raise InvalidArgument(
                f"max_message_bytes: {requested} is not in [65536, {self.config.max_message_bytes}]"
            )
        return requested

    @unary
    def PutArtifact(self, request_iterator, call):
        """The id, declaring the size (refused over quota or room before any data), then
        the data, then its checksum; the declared bytes stay reserved while they arrive."""
        messages = client_stream(request_iterator)
        first = next(messages, None)
        if first is None or first.WhichOneof("part") != "id":
            raise InvalidArgument("put_artifact: the first message must be the id")
        ident = first.id
        tenant, space = self._writer(call, ident.namespace)
        layout = layout_of(ident)
        self.config.layouts.check(layout, "id.layout")
        self._check_spec(ident.compressor)
        pace = Pace(self.config.puts, ident.size, "put_artifact")
        with self._admit_artifact(ident.size, tenant) as held, self.pacer.watch(call, pace):
            data = self._artifact_data(messages, ident.size, held, pace)
        stored = self.shard.put_artifact(
            space,
            layout,
            ident.prefix_key,
            ident.prefix_tokens,
            ident.compressor,
            data,
            tenant.name,
            self.quota,
            ident.signature,
        )
        return pb.PutResponse(chunk_keys=[ident.prefix_key], stored_bytes=stored)

    def _admit_artifact(self, size: int, tenant: Tenant) -> Reservation:
        """Refuse an artifact by its declared size, before any of its bytes is buffered."""
        if not 0 < size <= self.config.max_put_bytes:
            raise InvalidArgument(
                f"id.size: {size} is not in [1, {self.config.max_put_bytes}] (declare the "
                "artifact's size before its data)"
            )
        owner, weight = tenant.name, getattr(tenant, "weight", None)
        return self.shard.reserve(owner, self.quota(owner), size, size, True, weight)

    def _artifact_data(self, messages, declared: int, held: Reservation, pace: Pace):
        """The artifact's bytes, copied as they arrive into one buffer of the declared size
        (each part held in the receive budget first); checked against its CRC-32C."""
        buffer, size = None, 0
        for message in messages:
            part = message.WhichOneof("part")
            if part == "data":
                self.check_size("PutArtifactRequest", message.ByteSize())
                n = len(message.data)
                if size + n > declared:
                    raise InvalidArgument(f"data: more than the declared id.size ({declared})")
                held.grow(n)
                if buffer is None:
                    buffer = np.empty(declared, dtype=np.uint8)
                memoryview(buffer)[size : size + n] = message.data
                size += n
                pace.arrived(n)
                del message  # not kept while the next one is awaited
            elif part == "crc32c":
                if size != declared:
                    raise InvalidArgument(f"data: {size} bytes arrived, {declared} declared")
                data = memoryview(buffer).toreadonly()
                if crc32c(data) != message.crc32c:
                    raise InvalidArgument("crc32c: the artifact arrived corrupted")
                return data
            else:
                raise InvalidArgument(f"put_artifact: unexpected {part or 'empty'} message")
        raise Aborted("put_artifact: the stream ended before its checksum; nothing was stored")

    @staticmethod
    def _check_spec(spec: str) -> None:
        if not spec or len(spec) > MAX_SPEC:
            raise InvalidArgument(f"compressor: must be 1-{MAX_SPEC} characters")

    @streaming
    def FetchArtifact(self, request, call):
        ident = request.id
        _, space = self._caller(call, ident.namespace)
        self._check_spec(ident.compressor)
        step = self._message_bytes(request.max_message_bytes)
        data, _, proof = self.shard.fetch_artifact(
            space, layout_of(ident), ident.prefix_key, ident.compressor
        )
        crc = crc32c(data)
        if not data:
            yield pb.FetchArtifactResponse(total_bytes=0, crc32c=crc, signature=proof.signature)
        for start in range(0, len(data), step):
            first, last = start == 0, start + step >= len(data)
            yield pb.FetchArtifactResponse(
                data=bytes(data[start : start + step]),  # stored as bytes or a view
                total_bytes=len(data) if first else 0,
                crc32c=crc if last else 0,
                signature=proof.signature if first else b"",
            )

    @streaming
    def Attend(self, requests, call):
        """Near-data attention (see `prefix_store.attend`): the header leases its chunks,
        then each query is answered with the partials over them, in order."""
        with self.attend_slots.admit(call.caller.name):
            messages = client_stream(requests)
            session = self._begin_attend(next(messages, None), call)
            self.attend_stats.opened()
            try:
                for message in messages:
                    yield self._answer(session, message)
            finally:
                session.close()

    def _begin_attend(self, first, call) -> attend.AttendSession:
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgument("attend: the first message must be the header")
        header = first.header
        _, space = self._caller(call, header.namespace)
        return attend.open_session(
            self.shard,
            space,
            layout_of(header),
            header,
            self.kernel,
            self.config.max_message_bytes,
        )

    def _answer(self, session: attend.AttendSession, message) -> pb.AttendResponse:
        if message.WhichOneof("kind") != "query":
            raise InvalidArgument("attend: after the header, only queries may come")
        response = session.answer(message.query)
        self.attend_stats.answered(
            message.query.rows,
            len(message.query.q),
            len(response.m) + len(response.l) + len(response.acc),
            response.compute_s,
        )
        return response

    @unary
    def Delete(self, request, call):
        """Deletes what the caller may: a namespace's owner anything in it, a writer what it
        stored itself (its quota pays for it); readers nothing."""
        tenant, space = self._writer(call, request.namespace)
        if len(request.chunk_keys) > MAX_CHUNKS_PER_FETCH:
            raise InvalidArgument(f"chunk_keys: at most {MAX_CHUNKS_PER_FETCH} per call")
        mine = Deletable(tenant.name, space.role == OWNER)
        if request.chunk_keys:
            chunks, artifacts, nbytes = self.shard.delete_keys(space, request.chunk_keys, mine)
        else:
            chunks, artifacts, nbytes = self.shard.delete(
                space, layout_of(request), request.token_ids, mine
            )
        return pb.DeleteResponse(chunks=chunks, artifacts=artifacts, bytes=nbytes)

    @unary
    def Stats(self, request, call):
        tenant, _ = self._caller(call)
        return pb.StatsResponse(**self.tenant_stats(tenant.name))

    def tenant_stats(self, tenant: str) -> dict:
        """What a tenant may see: capacities and its own data. Shard-wide activity (other
        tenants' bytes, hits, fetches) stays with operators (`vericache status`)."""
        counts = self.shard.counts(owner=tenant)
        return {
            "shard_id": self.config.shard_id,
            "memory_capacity": self.shard.memory.capacity,
            "disk_capacity": self.shard.disk.capacity,
            "chunks": counts["chunks"],
            "artifacts": counts["artifacts"],
            "tenant_bytes": self.shard.usage().get(tenant, 0),
        }

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


def server_options(config: ShardConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        # gRPC has one receive limit for every method: the streams' messages (Put segment
        # batches, PutArtifact data) need `max_message_bytes`; a little more lets one over
        # it get INVALID_ARGUMENT naming the limit (`REQUEST_SLACK`). Unary requests are
        # bounded lower by their handlers before they are parsed (`request_limit`).
        ("grpc.max_receive_message_length", config.max_message_bytes + REQUEST_SLACK),
        ("grpc.http2.lookahead_bytes", 16 << 20),
        ("grpc.http2.bdp_probe", 1),
        ("grpc.so_reuseport", 0),
        # Clients ping every few seconds while calls are open, to find dead links fast.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def receive_put(conn, session, bounds: PutBounds) -> None:
    """The data-plane side of OpenPut: every layer frame straight into the session's
    buffers, then the commit frame; answers with the PutResponse. The transfer keeps to
    `bounds` (`pace`): one past its deadline or below its minimum rate is cut with a
    DEADLINE_EXCEEDED frame."""
    layout = session.layout
    pace = Pace(bounds, session.total_bytes)
    idle = conn.gettimeout()
    for layer in range(layout.num_layers):
        magic, got, chunks, size = read_frame_header(conn)
        if (magic, got, chunks, size) != (OK, layer, len(session.indices), session.layer_bytes):
            raise InvalidArgument(
                f"frame: expected layer {layer} of {len(session.indices)} chunks "
                f"({session.layer_bytes} bytes), got {(magic, got, chunks, size)}"
            )
        for view in session.layer_views(layer):
            recv_paced(conn, view, pace, idle)
    magic, _, chunks, size = read_frame_header(conn)
    if magic != COMMIT or chunks != len(session.indices) or size != 4 * chunks:
        raise InvalidArgument("frame: expected the commit frame with one CRC-32C per chunk")
    crcs = bytearray(size)
    recv_exact(conn, memoryview(crcs))
    done = session.commit(list(struct.unpack(f"<{chunks}I", crcs)))
    reply = pb.PutResponse(
        chunk_keys=done.keys, stored_bytes=done.new_bytes, new_keys=done.new_keys
    ).SerializeToString()
    conn.sendall(HEADER.pack(DONE, 0, 0, len(reply)) + reply)


def recv_paced(conn, view: memoryview, pace: Pace, idle: float | None) -> None:
    """Fill a flat view from `conn`, counting what arrives against `pace`: waits no longer
    than the pace allows (DeadlineExceeded) nor than `idle` (the socket's timeout)."""
    while view.nbytes:
        wait = max(0.001, pace.due() - time.monotonic())
        conn.settimeout(wait if idle is None else min(idle, wait))
        try:
            n = conn.recv_into(view)
        except TimeoutError:
            pace.check()
            if idle is not None and wait >= idle:
                raise
            continue
        if n == 0:
            raise ConnectionError("the peer closed the data connection mid-transfer")
        view = view[n:]
        pace.arrived(n)


def _same(raw: bytes) -> bytes:
    return raw


def handlers(servicer: PrefixStoreServicer) -> grpc.GenericRpcHandler:
    """The service's method table, as the generated `add_PrefixStoreServicer_to_server`
    builds it, except that requests (and Fetch responses) stay serialised bytes: each
    handler authenticates before it parses (`unary`, `streaming`)."""

    def method(kind, name: str, response=serialize):
        return kind(
            getattr(servicer, name), request_deserializer=_same, response_serializer=response
        )

    methods = {
        name: method(grpc.unary_unary_rpc_method_handler, name)
        for name in ("Describe", "Lookup", "Delete", "OpenFetch", "OpenPut", "Stats")
    }
    methods["Put"] = method(grpc.stream_unary_rpc_method_handler, "Put")
    methods["PutArtifact"] = method(grpc.stream_unary_rpc_method_handler, "PutArtifact")
    methods["Fetch"] = method(grpc.unary_stream_rpc_method_handler, "Fetch", _same)
    methods["FetchArtifact"] = method(grpc.unary_stream_rpc_method_handler, "FetchArtifact")
    methods["Attend"] = method(grpc.stream_stream_rpc_method_handler, "Attend")
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def create_server(servicer: PrefixStoreServicer, config: ShardConfig) -> tuple[grpc.Server, int]:
    """A server with the store, health checking and reflection; binds `config.port`
    (0 = a free port; TLS when `config.tls`) and returns the port actually bound."""
    return grpc_server(
        handlers(servicer), SERVICE, f"{config.host}:{config.port}", config.tls,
        workers=config.workers, name="store", options=server_options(config),
    )  # fmt: skip


class ShardServer:
    """A shard serving gRPC and heartbeating its membership and usage into Redis."""

    def __init__(self, config: ShardConfig, redis_url: str) -> None:
        self.config = config
        self.metadata = Metadata(redis_url)
        self.shard = Shard(config)
        self.data_plane = None
        data_address = ""
        if config.data_port is not None:
            tls = server_context(config.tls) if config.tls is not None else None
            self.data_plane = DataPlane(config.host, config.data_port, config.data_limits, tls)
            data_address = f"{config.advertised}:{self.data_plane.port}"
        self.servicer = PrefixStoreServicer(
            self.shard, self.metadata, config, self.data_plane, data_address
        )
        self.server, self.port = create_server(self.servicer, config)
        self.address = f"{config.advertised}:{self.port}"
        self.data_address = data_address
        self.metrics, self.metrics_url = metrics_endpoint(
            self.servicer.metrics.registry, config.metrics, config.host, config.advertised,
            config.tls,
        )  # fmt: skip
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        self.scrubber = Scrubber(self.shard, config.scrub_rate) if config.scrub_rate else None

    def start(self) -> str:
        self.server.start()
        if self.data_plane is not None:
            self.data_plane.start()
        if self.metrics is not None:
            self.metrics.start()
        self._heartbeat()
        self._beat.start()
        if self.scrubber is not None:
            self.scrubber.start()
        log.info("shard %s serving on %s", self.config.shard_id, self.address)
        return self.address

    def _heartbeat(self) -> None:
        info = {
            **self.servicer.shard_stats(),
            "data_address": self.data_address,
            "attention_kernel": self.servicer.kernel,
            "metrics_url": self.metrics_url,
        }
        self.metadata.heartbeat(
            self.config.shard_id, self.address, info, self.shard.usage(), self.config.ttl_s
        )

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            try:
                self._heartbeat()
            except Exception as error:  # noqa: BLE001 - keep beating until Redis is back
                log.warning("shard %s: heartbeat failed: %s", self.config.shard_id, error)

    def stop(self, grace_s: float | None = None) -> None:
        """Leave the membership, finish in-flight RPCs, persist memory to disk."""
        self._stop.set()
        try:
            self.metadata.deregister(self.config.shard_id)
        except Exception as error:  # noqa: BLE001
            log.warning("shard %s: deregister failed: %s", self.config.shard_id, error)
        if self.data_plane is not None:
            self.data_plane.stop()
        if self.metrics is not None:
            self.metrics.stop()
        if self.scrubber is not None:
            self.scrubber.stop()
        self.server.stop(self.config.grace_s if grace_s is None else grace_s).wait()
        self.shard.flush()
