"""The synchronous client SDK: `lookup`, `publish_prefix`, `fetch_layers`/`start_fetch`
and artifact calls, on threads. An I/O shell over `client.core.ClientCore`, which decides
placement, failover, quarantine, retries, deadlines, membership refresh and the undo of a
failed publish (the same for `AsyncStoreClient`).

Thread-safe. Transfers run on parallel streams (`ClientConfig.streams`, at least one per
shard, on separate connections) straight into caller-owned tensors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.client.channels import Connections
from prefix_store.client.core import (
    ClientCore,
    FetchRoute,
    FetchStream,
    Publish,
    PublishResult,
    PutStream,
)
from prefix_store.client.link import LinkMeter
from prefix_store.client.near_data import AttendRoute, AttentionSession
from prefix_store.client.plan import (
    ArtifactReceipt,
    Assembly,
    CachedPrefix,
    ReceivedArtifact,
    Topology,
    artifact_messages,
    declared_id,
)
from prefix_store.client.retry import Attempts, retrying, stopping
from prefix_store.client.transfer import Cancels, receive
from prefix_store.config import ClientConfig
from prefix_store.errors import StoreError
from prefix_store.layout import KVLayout
from prefix_store.protocol.frames import redemption
from prefix_store.provenance import Signer, Verifier
from prefix_store.tls import make_channel

__all__ = ["FetchHandle", "PublishResult", "StoreClient", "receive"]


def backed_off(assembly, delay_s: float) -> bool:
    """Wait `delay_s` (every owner refused a stream as busy); False if the fetch stopped
    meanwhile."""
    until = time.monotonic() + delay_s
    while not assembly.stopped:
        left = until - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(0.05, left))
    return False


def outcome(call, *args):
    """`call(*args)`, or the StoreError it raised."""
    try:
        return call(*args)
    except StoreError as error:
        return error


class FetchHandle:
    """A transfer in flight. `wait_layer(i)` blocks until layer i is in the outputs, so a
    consumer can compute on layer i while later layers arrive; `wait()` for all.

    When a wait fails (or `cancel` is called) every stream is cut and joined before control
    returns: nothing writes into the outputs after that."""

    def __init__(self, assembly: Assembly, timeout_s: float) -> None:
        self.assembly = assembly
        self.timeout_s = timeout_s
        self._streams = Cancels()
        self._lanes: list[futures.Future] = []
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self._streams.cancelled

    def track(self, call) -> None:
        """Register something with a `cancel()` (a gRPC call, a data-plane socket)."""
        self._streams.track(call)

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
        self.assembly.close()
        self._streams.cancel_all()
        while True:
            with self._lock:
                pending = [lane for lane in self._lanes if not lane.done()]
            if not pending:
                return
            futures.wait(pending, timeout=self.timeout_s)


class StoreClient:
    def __init__(
        self,
        endpoints: str | Sequence[str],
        token: str,
        config: ClientConfig | None = None,
        link: LinkMeter | None = None,
    ) -> None:
        """link: where `fetch_layers` and `fetch_artifact` record their rate (one meter may
        serve every client of a process); a meter of its own by default."""
        self.core = ClientCore(endpoints, config)
        self.link = link if link is not None else LinkMeter()
        self.config, self.endpoints = self.core.config, self.core.endpoints
        self._conn = Connections(self.config, token, make_channel)
        self._metadata = self._conn.metadata
        self._pool = futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="store-client")
        try:
            self.describe()
        except BaseException:
            self.close()  # an unknown token or no store: nothing of this client stays open
            raise

    @property
    def topology(self) -> Topology:
        """The shards chunks are placed on (see `client.membership`), the caller's salts."""
        return self.core.topology

    def suspects(self) -> frozenset[str]:
        """Shards that failed within the last `quarantine_s`."""
        return self.core.suspects()

    def events(self) -> dict[str, int]:
        """Failovers by cause and shards found unreachable, since this client was made."""
        return self.core.events()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for channel in self._conn.take():
            channel.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stub(self, address: str, lane: int = 0):
        return self._conn.stub(address, lane)

    def _bulk_put(self, address: str, lane: int):
        return self._conn.bulk_put(address, lane)

    # ---- membership and unary calls -------------------------------------------------------

    def describe(self) -> Topology:
        """Ask any endpoint (or known shard) who we are and which shards are live; the
        membership then follows the rule of `client.membership`. An answered call's time is
        a round trip for `link`."""
        request, deadline = pb.DescribeRequest(), self.core.deadlines.call

        def describe(address: str):
            started = time.perf_counter()
            reply = self._conn.call(address, "Describe", request, deadline)
            self.link.record_round_trip(time.perf_counter() - started)
            return reply

        return self.core.observe(retrying(self.core.describe_attempts(), describe))

    def _fresh(self) -> Topology:
        """The topology, refreshed first when due (a failed refresh keeps the last one)."""
        if self.core.claim_refresh():
            self.core.refresh_done(outcome(self.describe))
        return self.core.topology

    def _unary(self, attempts: Attempts, method: str, request):
        deadline = self.core.deadlines.call
        call = lambda shard_id: self._conn.call(
            self.core.address(shard_id), method, request, deadline
        )  # noqa: E731
        return retrying(attempts, call)

    def _on_each(self, method: str, request) -> list:
        """`method` on every listed shard (sorted), in parallel."""
        jobs = [
            self._pool.submit(self._unary, self.core.attempts([s]), method, request)
            for s in self._fresh().live
        ]
        return [job.result() for job in jobs]

    # ---- lookup ---------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], layout: KVLayout, namespace: str = "") -> CachedPrefix:
        """The longest cached prefix of `tokens` in `namespace` (tokens == 0 on a miss)."""
        self._fresh()
        lookup = self.core.plan_lookup(tokens, layout, namespace)
        while lookup.calls:
            jobs = [
                self._pool.submit(outcome, self._unary, c.attempts, "Lookup", c.request)
                for c in lookup.calls
            ]
            self.core.answered(lookup, [job.result() for job in jobs])
        return lookup.result()

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
        without it they are stored unsigned, which no decoder verifies against. A publish
        that leaves a chunk without any copy (or fails other than UNAVAILABLE) is undone."""
        self._fresh()
        publish = self.core.plan_publish(tokens, kv, layout, namespace, signer)
        jobs = [(s, self._pool.submit(self._put, publish, s)) for s in publish.streams]
        settled = self.core.settle(publish, [(s, outcome(job.result)) for s, job in jobs])
        for shard_id, request in self.core.undo(publish, settled):
            attempts = self.core.attempts([shard_id])
            self.core.undone(shard_id, request, outcome(self._unary, attempts, "Delete", request))
        return self.core.published(publish, settled)

    def _put(self, publish: Publish, stream: PutStream) -> pb.PutResponse:
        deadlines = self.core.deadlines

        def call(_: str) -> pb.PutResponse:
            if stream.data_address is not None:
                header = publish.header(stream)
                ticket = self._conn.call(stream.address, "OpenPut", header, deadlines.idle)
                return self._conn.send_put(publish, stream, ticket.ticket, deadlines.stream)
            messages = publish.messages(stream, self.config.message_bytes)
            put = self._conn.bulk_put(stream.address, stream.lane)
            return put(messages, metadata=self._metadata, timeout=deadlines.stream)

        return retrying(self.core.attempts([stream.shard_id], wait_when_busy=True), call)

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
        = layer_start). Returns at once; the handle says when each layer is complete. A
        stream that fails continues on a replica (see `client.core`)."""
        self._fresh()
        route = self.core.fetch_route(prefix, k_out, v_out, layer_start, layer_end)
        handle = FetchHandle(route.assembly, self.core.deadlines.stream)
        self._run(handle, route, route.start())
        return handle

    def fetch_layers(
        self, prefix: CachedPrefix, k_out, v_out, layer_start=0, layer_end=None
    ) -> int:
        """`start_fetch` and wait; returns the bytes received (and records the rate in
        `link`)."""
        started = time.perf_counter()
        nbytes = self.start_fetch(prefix, k_out, v_out, layer_start, layer_end).wait()
        self.link.record(nbytes, time.perf_counter() - started)
        return nbytes

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

    def _run(self, handle: FetchHandle, route: FetchRoute, streams: list[FetchStream]) -> None:
        for stream in streams:
            handle.add_lane(self._pool.submit(self._stream, handle, route, stream))

    def _stream(self, handle: FetchHandle, route: FetchRoute, stream: FetchStream) -> None:
        try:
            if stream.delay_s and not backed_off(handle.assembly, stream.delay_s):
                return
            if stream.data_address is not None:
                self._stream_data_plane(handle, stream)
            else:
                self._stream_grpc(handle, stream)
        except Exception as error:  # noqa: BLE001 - the route decides: replica or failure
            self._run(handle, route, route.failed(stream, error))

    def _stream_grpc(self, handle: FetchHandle, stream: FetchStream) -> None:
        fetch = self._conn.bulk_fetch(stream.address, stream.lane)
        call = fetch(stream.request, metadata=self._metadata, timeout=self.core.deadlines.stream)
        handle.track(call)
        for response in call:
            handle.assembly.apply(stream.chunks, response)

    def _stream_data_plane(self, handle: FetchHandle, stream: FetchStream) -> None:
        idle = self.core.deadlines.idle
        ticket = self._conn.call(stream.address, "OpenFetch", stream.request, idle)
        redeem = redemption(ticket.ticket, self._conn.token)
        layer_from = stream.request.layer_start
        receive(
            stream.data_address,
            redeem,
            handle.assembly,
            stream.chunks,
            layer_from,
            idle,
            track=handle.track,
            tls=self._conn.data_tls,
        )

    # ---- near-data attention ----------------------------------------------------------------

    def open_attention(self, prefix: CachedPrefix, heads: int, kernel: str) -> AttentionSession:
        """A session computing attention partials over the prefix's full chunks on the
        shards that hold them (`heads` query heads; `kernel`: the caller's kernel
        fingerprint, which the shards must serve). Opens nothing yet: the first query opens
        one stream per owner shard (see `client.near_data`)."""
        self._fresh()
        return AttentionSession(
            self.core, self._conn, AttendRoute(self.core, prefix, heads, kernel)
        )

    # ---- artifacts, delete, stats ---------------------------------------------------------

    def put_artifact(
        self, prefix: CachedPrefix, spec: str, data: bytes, signer: Signer | None = None
    ) -> int:
        """Store a compressed artifact of a cached prefix on all its owners (signed with
        `signer` when given); returns the bytes stored. Fails when no owner took it.
        `data`: bytes-like, or an `Arriving` buffer still being filled (sent a piece at a
        time as its bytes come).

        Over the data plane (every owner has one) a put has two phases: every owner first
        grants a ticket (quota and room checked, the bytes held against its quota); one
        refusing (other than UNAVAILABLE) refuses the put before any byte moves, and the
        others' tickets are given back, so none stores it. An owner refusing after the
        bytes moved (room taken meanwhile, a signed copy held) leaves the others' copies."""
        self._fresh()
        ident = self.core.artifact_id(prefix, spec, data, signer)
        owners = self.core.artifact_owners(prefix, spec)
        lanes = self.core.artifact_data_plane(owners)
        if lanes is None:
            jobs = [self._pool.submit(self._put_artifact, s, ident, data) for s in owners]
            return self.core.artifact_stored([outcome(job.result) for job in jobs])
        declared = declared_id(ident, data)
        opens = [(s, self._pool.submit(self._open_put_artifact, s, declared)) for s in owners]
        unsent: dict[str, bytes] = {}
        try:
            opened = []
            for shard_id, job in opens:
                opened.append(outcome(job.result))
                if not isinstance(opened[-1], BaseException):
                    unsent[shard_id] = opened[-1].ticket
            refusal = self.core.artifact_refusal(opened)
            if refusal is not None:
                raise refusal
            deadline = self.core.deadlines.stream
            send = self._conn.send_artifact
            sends = [
                self._pool.submit(send, lanes[s], unsent.pop(s), data, deadline)
                for s in list(unsent)
            ]
        finally:
            for shard_id, ticket in unsent.items():  # refused, or an error before sending
                self._conn.abandon(lanes[shard_id], ticket)
        failed = [o for o in opened if isinstance(o, BaseException)]
        return self.core.artifact_stored(failed + [outcome(job.result) for job in sends])

    def _open_put_artifact(self, shard_id: str, declared: pb.ArtifactId) -> pb.TransferTicket:
        def call(target: str) -> pb.TransferTicket:
            address, idle = self.core.address(target), self.core.deadlines.idle
            try:
                return self._conn.call(address, "OpenPutArtifact", declared, idle)
            except grpc.RpcError as error:  # a shard stopping meanwhile: the others store it
                gone = stopping(error, target, "OpenPutArtifact")
                if gone is None:
                    raise
                raise gone from error

        return retrying(self.core.attempts([shard_id]), call)

    def _put_artifact(self, shard_id: str, ident: pb.ArtifactId, data: bytes) -> int:
        deadline = self.core.deadlines.stream

        def call(target: str) -> int:
            messages = artifact_messages(ident, data, self.config.message_bytes)
            address = self.core.address(target)
            return self._conn.call(address, "PutArtifact", messages, deadline).stored_bytes

        return retrying(self.core.attempts([shard_id]), call)

    def fetch_artifact(
        self, prefix: CachedPrefix, spec: str, verifier: Verifier | None = None
    ) -> bytes | bytearray | None:
        """The artifact's bytes (a bytearray when they came over the data plane), or None
        when no owner holds it (with `verifier`: none holds one whose signature verifies).
        A found artifact's rate is recorded in `link`."""
        self._fresh()
        started = time.perf_counter()
        search = self.core.artifact_search(prefix, spec, verifier)
        for shard_id in search:
            attempts = self.core.attempts([shard_id])
            read = lambda s: self._read_artifact(s, search.request)  # noqa: E731
            search.take(shard_id, outcome(retrying, attempts, read))
        if search.found is not None:
            self.link.record(len(search.found), time.perf_counter() - started)
        return search.found

    def has_artifact(self, prefix: CachedPrefix, spec: str) -> bool:
        """Whether an owner holds the artifact (each asked streams one small message)."""
        self._fresh()
        probe = self.core.artifact_probe(prefix, spec)
        for shard_id in probe:
            attempts = self.core.attempts([shard_id])
            peek = lambda s: self._peek_artifact(s, probe.request)  # noqa: E731
            probe.take(shard_id, outcome(retrying, attempts, peek))
        return probe.found

    def _peek_artifact(self, shard_id: str, request) -> bool:
        address, deadline = self.core.address(shard_id), self.core.deadlines.call
        call = self._conn.call(address, "FetchArtifact", request, deadline)
        try:
            return next(call, None) is not None
        finally:
            call.cancel()

    def _read_artifact(self, shard_id: str, request) -> ArtifactReceipt | ReceivedArtifact:
        address, lane = self.core.address(shard_id), self.core.data_address(shard_id)
        if lane is not None:
            ticket = self._conn.call(
                address, "OpenFetchArtifact", request, self.core.deadlines.idle
            )
            data = self._conn.receive_artifact(lane, ticket, self.core.deadlines.stream)
            return ReceivedArtifact(data, ticket.signature)
        receipt = ArtifactReceipt()
        for message in self._conn.call(
            address, "FetchArtifact", request, self.core.deadlines.stream
        ):
            receipt.add(message)
        return receipt

    def delete_prefix(self, tokens: Sequence[int], layout: KVLayout, namespace: str = "") -> int:
        """Delete the prefix's chunks and artifacts on every listed shard; returns bytes
        freed."""
        request = self.core.delete_request(tokens, layout, namespace)
        return sum(response.bytes for response in self._on_each("Delete", request))

    def stats(self) -> list[pb.StatsResponse]:
        """Every listed shard's figures, sorted by shard id."""
        return self._on_each("Stats", pb.StatsRequest())
