"""The synchronous client SDK: chunking, placement, retries and failover hidden behind
`lookup`, `publish_prefix`, `fetch_layers`/`start_fetch` and artifact calls.

Thread-safe. Every call has a deadline (`ClientConfig`). Transfers run on parallel
streams (`ClientConfig.streams`, at least one per shard, on separate connections) straight
into caller-owned tensors; a stream that fails with UNAVAILABLE, DATA_LOSS or NOT_FOUND
continues from its first incomplete layer on the next replica of its chunks.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from prefix_store.blob import crc32c
from prefix_store.client.plan import (
    Assembly,
    CachedPrefix,
    Topology,
    artifact_id,
    artifact_messages,
    artifact_statement_of,
    as_layers,
    cached_prefix,
    fetch_request,
    group_by_owner,
    lanes,
    lookup_requests,
    placement,
    plan_chunks,
    put_header,
    put_messages,
    settle,
    signed_chunks,
)
from prefix_store.client.retry import retrying, rpc_error
from prefix_store.client.transfer import receive, send_put
from prefix_store.config import ClientConfig
from prefix_store.data_plane import redemption
from prefix_store.errors import DataLoss, InvalidArgument, NotFound, StoreError, Unavailable
from prefix_store.layout import KVLayout
from prefix_store.provenance import Signer, Verifier
from prefix_store.shard import validate_tokens
from prefix_store.status import FAILOVER
from prefix_store.tls import client_context, make_channel

log = logging.getLogger(__name__)


PUT_METHOD = "/vericache.v1.PrefixStore/Put"
FETCH_METHOD = "/vericache.v1.PrefixStore/Fetch"


def _same(raw: bytes) -> bytes:
    return raw


def channel_options(config: ClientConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.http2.lookahead_bytes", config.window_bytes),
        ("grpc.http2.bdp_probe", 1),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.enable_retries", 0),
        # A peer that stops answering is found within ~idle_timeout_s, not at the deadline.
        ("grpc.keepalive_time_ms", int(config.idle_timeout_s * 500)),
        ("grpc.keepalive_timeout_ms", int(config.idle_timeout_s * 500)),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def data_plane_tls(config: ClientConfig) -> ssl.SSLContext | None:
    """The data plane's TLS context for `config.tls` (built once per client); None: plain."""
    return client_context(config.tls) if config.tls is not None else None


def exhausted(error: NotFound, failed: frozenset, cause: StoreError | None) -> StoreError:
    """The error of a fetch that ran out of replicas: a miss (NOT_FOUND, or corrupt
    everywhere) stays a miss; otherwise the shards were unavailable."""
    detail = f"fetch: {error} (tried {', '.join(sorted(failed))})"
    if isinstance(cause, NotFound | DataLoss):
        return NotFound(f"{detail}: {cause}")
    return Unavailable(f"{detail}: {cause}" if cause else detail)


def failover_error(error: BaseException) -> StoreError | None:
    """The typed error of a failed fetch stream if another replica may succeed, else None."""
    if isinstance(error, grpc.RpcError):
        return rpc_error(error) if error.code() in FAILOVER else None
    if isinstance(error, Unavailable | DataLoss | NotFound):
        return error
    return None


def artifact_placement(prefix_key: int, spec: str) -> int:
    digest = hashlib.blake2b(prefix_key.to_bytes(8, "big") + spec.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big")


@dataclass(frozen=True, slots=True)
class PublishResult:
    prefix: CachedPrefix
    stored_bytes: int
    """Bytes newly stored, replicas included (chunks already present cost nothing)."""
    missing_replicas: int
    """Chunk copies that could not be placed (their shard was down); each chunk has >= 1."""


class FetchHandle:
    """A transfer in flight. `wait_layer(i)` blocks until layer i is in the outputs, so a
    consumer can compute on layer i while later layers arrive; `wait()` for all.

    When a wait fails (or `cancel` is called) every stream is cut and joined before control
    returns: nothing writes into the outputs after that."""

    def __init__(self, assembly: Assembly, timeout_s: float) -> None:
        self.assembly = assembly
        self.timeout_s = timeout_s
        self._calls: list = []
        self._lanes: list[futures.Future] = []
        self._lock = threading.Lock()
        self.cancelled = False

    def track(self, call) -> None:
        """Register something with a `cancel()` (a gRPC call, a data-plane socket)."""
        with self._lock:
            self._calls.append(call)
            if self.cancelled:
                call.cancel()

    def add_lane(self, lane: futures.Future) -> None:
        with self._lock:
            self._lanes.append(lane)

    def wait_layer(self, layer: int) -> None:
        try:
            self.assembly.wait_layer(layer, self.timeout_s)
        except BaseException:
            self.cancel()
            raise

    def wait(self) -> int:
        """Block until every layer arrived; returns the bytes received."""
        for layer in range(self.assembly.layer_start, self.assembly.layer_end):
            self.wait_layer(layer)
        return self.assembly.bytes

    def cancel(self) -> None:
        """Cut every stream and wait until none can write into the outputs any more."""
        with self._lock:
            self.cancelled = True
            self.assembly.close()
            for call in self._calls:
                call.cancel()
        while True:
            with self._lock:
                pending = [lane for lane in self._lanes if not lane.done()]
            if not pending:
                return
            futures.wait(pending, timeout=self.timeout_s)


class StoreClient:
    def __init__(
        self, endpoints: str | Sequence[str], token: str, config: ClientConfig | None = None
    ) -> None:
        self.config = config or ClientConfig()
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise InvalidArgument("endpoints: at least one host:port is required")
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._token = token
        self._data_tls = data_plane_tls(self.config)
        self._channels: dict[tuple[str, int], grpc.Channel] = {}
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="store-client")
        self.topology: Topology | None = None
        self._down: dict[str, float] = {}
        """Shards that failed recently -> until when (monotonic) to prefer their replicas."""
        try:
            self.describe()
        except BaseException:
            self.close()  # an unknown token or no store: nothing of this client stays open
            raise

    # ---- plumbing -------------------------------------------------------------------------

    def _channel(self, address: str, lane: int = 0) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get((address, lane))
            if channel is None:
                channel = make_channel(address, channel_options(self.config), self.config.tls)
                self._channels[(address, lane)] = channel
        return channel

    def _stub(self, address: str, lane: int = 0) -> pb_grpc.PrefixStoreStub:
        return pb_grpc.PrefixStoreStub(self._channel(address, lane))

    def _bulk_put(self, address: str, lane: int):
        """Put taking serialised requests (built by `plan.put_messages`)."""
        return self._channel(address, lane).stream_unary(
            PUT_METHOD, request_serializer=_same, response_deserializer=pb.PutResponse.FromString
        )

    def _bulk_fetch(self, address: str, lane: int):
        """Fetch returning serialised responses (parsed by `Assembly.apply`)."""
        return self._channel(address, lane).unary_stream(
            FETCH_METHOD,
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=_same,
        )

    def _address(self, shard_id: str) -> str:
        return self.topology.shards[shard_id]

    def _suspect(self, shard_id: str) -> None:
        with self._lock:
            self._down[shard_id] = time.monotonic() + self.config.quarantine_s

    def suspects(self) -> frozenset[str]:
        """Shards that failed within the last `quarantine_s`."""
        now = time.monotonic()
        with self._lock:
            return frozenset(s for s, until in self._down.items() if until > now)

    def _healthy_first(self, shard_ids: Sequence[str]) -> list[str]:
        suspects = self.suspects()
        return sorted(shard_ids, key=lambda shard_id: shard_id in suspects)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> Topology:
        """Ask any endpoint (or known shard) who we are and which shards are live."""
        known = list(self.topology.shards.values()) if self.topology else []
        targets = list(dict.fromkeys(self.endpoints + known))
        response = retrying(
            self.config,
            targets,
            lambda address: self._stub(address).Describe(
                pb.DescribeRequest(), metadata=self._metadata, timeout=self.config.timeout_s
            ),
        )
        self.topology = Topology.from_proto(response)
        if not self.topology.shards:
            raise Unavailable("the store has no live shards")
        return self.topology

    def _unary(self, shard_ids: Sequence[str], method: str, request):
        def call(shard_id: str):
            stub = self._stub(self._address(shard_id))
            try:
                return getattr(stub, method)(
                    request, metadata=self._metadata, timeout=self.config.timeout_s
                )
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    self._suspect(shard_id)
                raise

        return retrying(self.config, self._healthy_first(shard_ids), call)

    # ---- lookup ---------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], layout: KVLayout, namespace: str = "") -> CachedPrefix:
        """The longest cached prefix of `tokens` in `namespace` (tokens == 0 on a miss)."""
        ids = validate_tokens(tokens)
        chunks = plan_chunks(ids, layout, self.topology.salt(namespace))
        if not chunks:
            return CachedPrefix(namespace, layout, 0, ())
        jobs = {
            self._pool.submit(self._unary, owners, "Lookup", request): group
            for owners, request, group in lookup_requests(
                ids, layout, namespace, chunks, self.topology
            )
        }
        answers = {c.index: job.result() for job, group in jobs.items() for c in group}
        return cached_prefix(namespace, layout, chunks, answers)

    # ---- publish --------------------------------------------------------------------------

    def publish_prefix(
        self,
        tokens: Sequence[int],
        kv,
        layout: KVLayout,
        namespace: str = "",
        signer: Signer | None = None,
    ) -> PublishResult:
        """Store the KV of `tokens` (per layer (k, v), each [kv_heads, >= len(tokens),
        head_dim], or a tensor [layers, 2, kv_heads, tokens, head_dim]) on every owner of
        every chunk. Each shard's part is a two-phase put: all of it or nothing. Chunks are
        signed with `signer` when given (decoders: the KV is the model's own exact KV);
        without it they are stored unsigned, which no decoder verifies against."""
        ids = validate_tokens(tokens)
        if not ids:
            raise InvalidArgument("tokens: at least one token is required")
        layers = as_layers(kv, layout, len(ids))
        chunks = plan_chunks(ids, layout, self.topology.salt(namespace))
        if signer is not None:
            chunks = signed_chunks(signer, layout, ids, chunks, layers)
        streams = lanes(placement(chunks, self.topology), self.config.streams)
        jobs = {}
        for shard_id, lane, part in streams:
            job = self._pool.submit(self._put, shard_id, lane, namespace, layout, ids, part, layers)
            jobs[job] = (shard_id, part)
        return self._publish_result(jobs, chunks, namespace, layout)

    def _publish_result(self, jobs, chunks, namespace, layout) -> PublishResult:
        outcomes = []
        for job, (shard_id, part) in jobs.items():
            try:
                outcomes.append((shard_id, part, job.result()))
            except StoreError as error:
                log.warning("publish: shard %s failed: %s", shard_id, error)
                outcomes.append((shard_id, part, error))
        settled = settle(chunks, outcomes, self.topology.replication)
        if settled.error is not None:
            self._undo(namespace, settled.done)
            raise settled.error
        prefix = CachedPrefix(namespace, layout, sum(c.tokens for c in chunks), tuple(chunks))
        return PublishResult(prefix, settled.stored_bytes, settled.missing_replicas)

    def _undo(self, namespace: str, done: list[tuple[str, list[int]]]) -> None:
        """Delete the chunks a failed publish stored (best effort: they are valid data)."""
        for shard_id, keys in done:
            if not keys:
                continue
            try:
                self._unary(
                    [shard_id], "Delete", pb.DeleteRequest(namespace=namespace, chunk_keys=keys)
                )
            except StoreError as error:
                log.warning(
                    "publish: could not undo %d chunks on %s: %s", len(keys), shard_id, error
                )

    def _put(self, shard_id, lane, namespace, layout, ids, chunks, layers) -> pb.PutResponse:
        def call(target: str) -> pb.PutResponse:
            if self.config.data_plane and target in self.topology.data_addresses:
                header = put_header(namespace, layout, ids, chunks)
                ticket = self._stub(self._address(target)).OpenPut(
                    header, metadata=self._metadata, timeout=self.config.timeout_s
                )
                address = self.topology.data_addresses[target]
                return send_put(
                    address,
                    redemption(ticket.ticket, self._token),
                    layout,
                    chunks,
                    layers,
                    self.config.stream_timeout_s,
                    self._data_tls,
                )
            put = self._bulk_put(self._address(target), lane)
            messages = put_messages(
                namespace, layout, ids, chunks, layers, self.config.message_bytes
            )
            return put(messages, metadata=self._metadata, timeout=self.config.stream_timeout_s)

        return retrying(self.config, [shard_id], call)

    # ---- fetch ----------------------------------------------------------------------------

    def start_fetch(
        self,
        prefix: CachedPrefix,
        k_out,
        v_out,
        layer_start: int = 0,
        layer_end: int | None = None,
    ) -> FetchHandle:
        """Begin streaming layers [layer_start, layer_end) of the cached prefix into
        `k_out`/`v_out` ([layers in range, kv_heads, >= prefix.tokens, head_dim] each, row 0
        = layer_start). Returns at once; the handle says when each layer is complete."""
        layer_end = prefix.layout.num_layers if layer_end is None else layer_end
        if not 0 <= layer_start < layer_end <= prefix.layout.num_layers:
            raise InvalidArgument(f"layers: [{layer_start}, {layer_end}) out of range")
        if not prefix.chunks:
            raise NotFound("fetch: the prefix has no cached chunks")
        assembly = Assembly(prefix, k_out, v_out, layer_start, layer_end)
        handle = FetchHandle(assembly, self.config.stream_timeout_s)
        self._spread(handle, list(prefix.chunks), layer_start, frozenset())
        return handle

    def fetch_layers(
        self, prefix: CachedPrefix, k_out, v_out, layer_start=0, layer_end=None
    ) -> int:
        """`start_fetch` and wait; returns the bytes received."""
        return self.start_fetch(prefix, k_out, v_out, layer_start, layer_end).wait()

    def iter_layers(
        self, prefix: CachedPrefix, k_out, v_out, layer_start=0, layer_end=None
    ) -> Iterator[int]:
        """Yield each layer index as soon as it is complete in the outputs."""
        handle = self.start_fetch(prefix, k_out, v_out, layer_start, layer_end)
        try:
            for layer in range(handle.assembly.layer_start, handle.assembly.layer_end):
                handle.wait_layer(layer)
                yield layer
        finally:
            handle.cancel()

    def _spread(
        self, handle: FetchHandle, chunks, layer_from: int, failed: frozenset, cause=None
    ) -> None:
        """Start streams for `chunks` from `layer_from` on their best owners not in `failed`,
        avoiding shards that failed recently while a replica is left; when none is left,
        fail with what the last owner said."""
        try:
            groups = self._owner_groups(chunks, failed)
        except NotFound as error:
            handle.assembly.fail(exhausted(error, failed, cause))
            return
        if layer_from >= handle.assembly.layer_end or handle.cancelled:
            return
        for shard_id, lane, part in lanes(groups, self.config.streams):
            handle.add_lane(
                self._pool.submit(self._stream, handle, shard_id, lane, part, layer_from, failed)
            )

    def _owner_groups(self, chunks, failed: frozenset) -> dict[str, list]:
        """Chunks by best owner not in `failed`, leaving out suspects where a replica is."""
        try:
            return group_by_owner(chunks, self.topology, failed | self.suspects())
        except NotFound:
            return group_by_owner(chunks, self.topology, failed)

    def _stream(self, handle: FetchHandle, shard_id, lane, chunks, layer_from, failed) -> None:
        """Fetch `chunks` from one shard (data plane when offered, else gRPC); on a failure
        another replica may fix, continue from the first incomplete layer elsewhere."""
        assembly = handle.assembly
        request = fetch_request(
            assembly.prefix, chunks, layer_from, assembly.layer_end, self.config.message_bytes
        )
        try:
            if self._use_data_plane(shard_id, assembly):
                self._stream_data_plane(handle, shard_id, request, chunks, layer_from)
            else:
                self._stream_grpc(handle, shard_id, lane, request, chunks)
        except Exception as error:  # noqa: BLE001 - every failure ends in the assembly
            if handle.cancelled:
                return
            cause = failover_error(error)
            if cause is None:
                assembly.fail(rpc_error(error) if isinstance(error, grpc.RpcError) else error)
                return
            log.warning("fetch: shard %s failed (%s); continuing from a replica", shard_id, cause)
            if isinstance(cause, Unavailable):
                self._suspect(shard_id)
            resume = assembly.first_missing_layer(chunks)
            self._spread(handle, chunks, resume, failed | {shard_id}, cause)

    def _use_data_plane(self, shard_id: str, assembly: Assembly) -> bool:
        return (
            self.config.data_plane and assembly.direct and shard_id in self.topology.data_addresses
        )

    def _stream_grpc(self, handle, shard_id, lane, request, chunks) -> None:
        call = self._bulk_fetch(self._address(shard_id), lane)(
            request, metadata=self._metadata, timeout=self.config.stream_timeout_s
        )
        handle.track(call)
        for response in call:
            handle.assembly.apply(chunks, response)

    def _stream_data_plane(self, handle, shard_id, request, chunks, layer_from) -> None:
        ticket = self._stub(self._address(shard_id)).OpenFetch(
            request, metadata=self._metadata, timeout=self.config.idle_timeout_s
        )
        address = self.topology.data_addresses[shard_id]
        receive(
            address,
            redemption(ticket.ticket, self._token),
            handle.assembly,
            chunks,
            layer_from,
            self.config.idle_timeout_s,
            track=handle.track,
            tls=self._data_tls,
        )

    # ---- artifacts, delete, stats ---------------------------------------------------------

    def put_artifact(
        self, prefix: CachedPrefix, spec: str, data: bytes, signer: Signer | None = None
    ) -> int:
        """Store a compressed artifact of a cached prefix on all its owners (signed with
        `signer` when given)."""
        signature = b""
        if signer is not None:
            signature = signer.sign(artifact_statement_of(prefix, spec, data))
        ident = artifact_id(prefix, spec, signature)
        owners = self.topology.owners(artifact_placement(prefix.key, spec))
        step = self.config.message_bytes

        def put(shard_id: str) -> int:
            def call(target: str) -> int:
                stub = self._stub(self._address(target))
                return stub.PutArtifact(
                    artifact_messages(ident, data, step),
                    metadata=self._metadata,
                    timeout=self.config.stream_timeout_s,
                ).stored_bytes

            return retrying(self.config, [shard_id], call)

        results = [self._pool.submit(put, s) for s in owners]
        stored, errors = 0, []
        for job in results:
            try:
                stored += job.result()
            except Unavailable as error:
                errors.append(error)
        if len(errors) == len(results):
            raise errors[0]
        return stored

    def fetch_artifact(
        self, prefix: CachedPrefix, spec: str, verifier: Verifier | None = None
    ) -> bytes | None:
        """The artifact's bytes, or None when no owner holds it (with `verifier`: none holds
        one whose signature verifies)."""
        ident = artifact_id(prefix, spec)
        request = pb.FetchArtifactRequest(id=ident, max_message_bytes=self.config.message_bytes)
        for shard_id in self.topology.owners(artifact_placement(prefix.key, spec)):
            try:
                data, signature = self._fetch_artifact_from(shard_id, request)
            except (NotFound, Unavailable, StoreError) as error:
                if not isinstance(error, NotFound | Unavailable) and "checksum" not in str(error):
                    raise
                continue
            statement = artifact_statement_of(prefix, spec, data)
            if verifier is None or verifier.verify(statement, signature):
                return data
            log.warning("artifact %s on %s is not signed by this deployment", spec, shard_id)
        return None

    def _fetch_artifact_from(self, shard_id: str, request) -> tuple[bytes, bytes]:
        def call(target: str) -> tuple[bytes, bytes]:
            stub = self._stub(self._address(target))
            parts, crc, signature = [], None, b""
            for message in stub.FetchArtifact(
                request, metadata=self._metadata, timeout=self.config.stream_timeout_s
            ):
                parts.append(message.data)
                crc = message.crc32c  # carried by the last message
                signature = signature or message.signature  # by the first
            data = b"".join(parts)
            if crc is None or crc32c(data) != crc:
                raise Unavailable("fetch_artifact: the artifact arrived corrupted")
            return data, signature

        return retrying(self.config, [shard_id], call)

    def delete_prefix(self, tokens: Sequence[int], layout: KVLayout, namespace: str = "") -> int:
        """Delete the prefix's chunks and artifacts on every shard; returns bytes freed."""
        request = pb.DeleteRequest(
            namespace=namespace, layout=layout.to_proto(pb), token_ids=validate_tokens(tokens)
        )
        jobs = [
            self._pool.submit(self._unary, [s], "Delete", request) for s in self.topology.shards
        ]
        return sum(job.result().bytes for job in jobs)

    def stats(self) -> list[pb.StatsResponse]:
        jobs = [
            self._pool.submit(self._unary, [s], "Stats", pb.StatsRequest())
            for s in sorted(self.topology.shards)
        ]
        return [job.result() for job in jobs]
