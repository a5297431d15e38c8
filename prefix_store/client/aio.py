"""The asyncio client SDK: the same operations and guarantees as `StoreClient`, on grpc.aio.
An I/O shell over `client.core.ClientCore`, like `StoreClient`: the same placement,
failover, quarantine, retries, deadlines, membership refresh and undo.

Use `await AsyncStoreClient.connect(endpoints, token)`. Fetches stream into caller-owned
tensors (a failed stream resumes on a replica from its first incomplete layer);
`iter_layers` is an async generator of completed layer indices.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc.aio
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.client import core as policy
from prefix_store.client.aio_attention import AsyncAttentionSession
from prefix_store.client.channels import Connections
from prefix_store.client.near_data import AttendRoute
from prefix_store.client.plan import (
    ArtifactReceipt,
    CachedPrefix,
    ReceivedArtifact,
    Topology,
    artifact_messages,
    declared_id,
)
from prefix_store.client.retry import Attempts, retrying_async, stopping
from prefix_store.client.transfer import Cancels, receive
from prefix_store.config import ClientConfig
from prefix_store.errors import StoreError, Unavailable
from prefix_store.layout import KVLayout
from prefix_store.protocol.frames import redemption
from prefix_store.provenance import Signer, Verifier
from prefix_store.tls import make_aio_channel


class Transfer:
    """One fetch's streams as asyncio tasks, and the wait for each layer."""

    def __init__(self, client: AsyncStoreClient, route: policy.FetchRoute) -> None:
        self.client, self.route, self.assembly = client, route, route.assembly
        self.tasks: set[asyncio.Task] = set()
        self.cancels = Cancels()
        self.progress = asyncio.Event()
        loop = asyncio.get_running_loop()
        self.assembly.listeners.append(lambda: loop.call_soon_threadsafe(self.progress.set))

    def run(self, streams: list[policy.FetchStream]) -> None:
        for stream in streams:
            task = asyncio.ensure_future(self._stream(stream))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _stream(self, stream: policy.FetchStream) -> None:
        try:
            if stream.delay_s:
                await asyncio.sleep(stream.delay_s)  # backing off: every owner was busy
            if self.assembly.stopped:
                return
            if stream.data_address is not None:
                await self.client._stream_data_plane(stream, self.assembly, self.cancels)
            else:
                await self.client._stream_grpc(stream, self.assembly)
        except Exception as error:  # noqa: BLE001 - the route decides: replica or failure
            self.run(self.route.failed(stream, error))
        self.progress.set()

    async def wait_layer(self, layer: int, timeout_s: float) -> None:
        """Until `layer` is complete; re-raise the transfer's failure."""
        while not self.assembly.layer_ready(layer):
            if self.assembly.error is not None:
                raise self.assembly.error
            if not self.tasks:
                raise Unavailable(f"fetch: layer {layer} never arrived")
            self.progress.clear()
            try:
                await asyncio.wait_for(self.progress.wait(), timeout_s)
            except TimeoutError as error:
                raise Unavailable(
                    f"fetch: layer {layer} did not arrive within {timeout_s:.0f} s"
                ) from error

    async def close(self, timeout_s: float) -> None:
        """Cut the streams, then wait for them: nothing may write into the outputs after."""
        self.assembly.close()
        self.cancels.cancel_all()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)
        for task in list(self.tasks):
            task.cancel()


async def outcome(job):
    """An awaitable's result, or the StoreError it raised."""
    try:
        return await job
    except StoreError as error:
        return error


class AsyncStoreClient:
    def __init__(self, endpoints, token: str, config: ClientConfig | None = None) -> None:
        self.core = policy.ClientCore(endpoints, config)
        self.config, self.endpoints = self.core.config, self.core.endpoints
        self._conn = Connections(self.config, token, make_aio_channel)

    @classmethod
    async def connect(cls, endpoints, token: str, config: ClientConfig | None = None):
        client = cls(endpoints, token, config)
        await client.describe()
        return client

    async def close(self) -> None:
        for channel in self._conn.take():
            await channel.close()

    async def __aenter__(self) -> AsyncStoreClient:
        if self.topology is None:
            await self.describe()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def topology(self) -> Topology | None:
        """As `StoreClient.topology`; None before the first `describe`."""
        return self.core.topology

    def suspects(self) -> frozenset[str]:
        """As `StoreClient.suspects`."""
        return self.core.suspects()

    def events(self) -> dict[str, int]:
        """As `StoreClient.events`."""
        return self.core.events()

    # ---- membership and unary calls -------------------------------------------------------

    async def describe(self) -> Topology:
        """As `StoreClient.describe`."""
        request, deadline = pb.DescribeRequest(), self.core.deadlines.call

        async def describe(address: str):
            return await self._conn.call(address, "Describe", request, deadline)

        return self.core.observe(await retrying_async(self.core.describe_attempts(), describe))

    async def _fresh(self) -> Topology:
        """The topology, refreshed first when due (a failed refresh keeps the last one)."""
        if self.core.claim_refresh():
            self.core.refresh_done(await outcome(self.describe()))
        return self.core.topology

    async def _unary(self, attempts: Attempts, method: str, request):
        deadline = self.core.deadlines.call

        async def call(shard_id: str):
            address = self.core.address(shard_id)
            return await self._conn.call(address, method, request, deadline)

        return await retrying_async(attempts, call)

    async def _on_each(self, method: str, request) -> list:
        """`method` on every listed shard (sorted), concurrently."""
        shards = (await self._fresh()).live
        calls = (self._unary(self.core.attempts([s]), method, request) for s in shards)
        return list(await asyncio.gather(*calls))

    # ---- lookup ---------------------------------------------------------------------------

    async def lookup(
        self, tokens: Sequence[int], layout: KVLayout, namespace: str = ""
    ) -> CachedPrefix:
        """The longest cached prefix of `tokens` in `namespace` (tokens == 0 on a miss)."""
        await self._fresh()
        lookup = self.core.plan_lookup(tokens, layout, namespace)
        while lookup.calls:
            calls = (outcome(self._unary(c.attempts, "Lookup", c.request)) for c in lookup.calls)
            self.core.answered(lookup, await asyncio.gather(*calls))
        return lookup.result()

    # ---- publish --------------------------------------------------------------------------

    async def publish_prefix(
        self,
        tokens: Sequence[int],
        kv,
        layout: KVLayout,
        namespace: str = "",
        *,
        signer: Signer | None = None,
    ) -> policy.PublishResult:
        """As `StoreClient.publish_prefix`."""
        await self._fresh()
        publish = self.core.plan_publish(tokens, kv, layout, namespace, signer)
        results = await asyncio.gather(*(outcome(self._put(publish, s)) for s in publish.streams))
        settled = self.core.settle(publish, list(zip(publish.streams, results, strict=True)))
        for shard_id, request in self.core.undo(publish, settled):
            deleted = self._unary(self.core.attempts([shard_id]), "Delete", request)
            self.core.undone(shard_id, request, await outcome(deleted))
        return self.core.published(publish, settled)

    async def _put(self, publish: policy.Publish, stream: policy.PutStream) -> pb.PutResponse:
        deadlines = self.core.deadlines

        async def call(_: str) -> pb.PutResponse:
            if stream.data_address is None:
                put = self._conn.bulk_put(stream.address, stream.lane)
                messages = iter(publish.messages(stream, self.config.message_bytes))
                return await put(messages, metadata=self._conn.metadata, timeout=deadlines.stream)
            header = publish.header(stream)
            ticket = await self._conn.call(stream.address, "OpenPut", header, deadlines.idle)
            send = self._conn.send_put
            return await asyncio.to_thread(send, publish, stream, ticket.ticket, deadlines.stream)

        attempts = self.core.attempts([stream.shard_id], wait_when_busy=True)
        return await retrying_async(attempts, call)

    # ---- fetch ----------------------------------------------------------------------------

    async def iter_layers(
        self, prefix: CachedPrefix, k_out, v_out, layer_start: int = 0, layer_end: int | None = None
    ) -> AsyncIterator[int]:
        """Stream layers into `k_out`/`v_out` (as `StoreClient.start_fetch`), yielding each
        layer index once it is complete."""
        await self._fresh()
        route = self.core.fetch_route(prefix, k_out, v_out, layer_start, layer_end)
        transfer = Transfer(self, route)
        transfer.run(route.start())
        try:
            for layer in range(route.assembly.layer_start, route.assembly.layer_end):
                await transfer.wait_layer(layer, self.core.deadlines.stream)
                yield layer
        finally:
            await transfer.close(self.core.deadlines.call)

    async def fetch_layers(self, prefix, k_out, v_out, layer_start=0, layer_end=None) -> int:
        """Stream all requested layers into the outputs; returns the bytes received."""
        async for _ in self.iter_layers(prefix, k_out, v_out, layer_start, layer_end):
            pass
        end = prefix.layout.num_layers if layer_end is None else layer_end
        return sum(prefix.layout.segment_bytes(c.tokens) for c in prefix.chunks) * (
            end - layer_start
        )

    async def _stream_grpc(self, stream: policy.FetchStream, assembly) -> None:
        fetch = self._conn.bulk_fetch(stream.address, stream.lane)
        deadline = self.core.deadlines.stream
        async for raw in fetch(stream.request, metadata=self._conn.metadata, timeout=deadline):
            assembly.apply(stream.chunks, raw)

    async def _stream_data_plane(self, stream: policy.FetchStream, assembly, cancels) -> None:
        idle, request = self.core.deadlines.idle, stream.request
        ticket = await self._conn.call(stream.address, "OpenFetch", request, idle)
        redeem, tls = redemption(ticket.ticket, self._conn.token), self._conn.data_tls
        args = (assembly, stream.chunks, request.layer_start, idle, cancels.track, tls)
        await asyncio.to_thread(receive, stream.data_address, redeem, *args)

    # ---- artifacts, delete, stats ---------------------------------------------------------

    # ---- near-data attention --------------------------------------------------------------

    async def open_attention(
        self, prefix: CachedPrefix, heads: int, kernel: str
    ) -> AsyncAttentionSession:
        """As `StoreClient.open_attention`: a session whose `await query(layer, q)` gives
        the partials computed by the shards holding the prefix's full chunks."""
        await self._fresh()
        return AsyncAttentionSession(
            self.core, self._conn, AttendRoute(self.core, prefix, heads, kernel)
        )

    async def put_artifact(
        self, prefix: CachedPrefix, spec: str, data: bytes, signer: Signer | None = None
    ) -> int:
        """As `StoreClient.put_artifact` (two phases over the data plane)."""
        await self._fresh()
        ident = self.core.artifact_id(prefix, spec, data, signer)
        owners = self.core.artifact_owners(prefix, spec)
        lanes = self.core.artifact_data_plane(owners)
        if lanes is None:
            puts = (outcome(self._put_artifact(s, ident, data)) for s in owners)
            return self.core.artifact_stored(list(await asyncio.gather(*puts)))
        declared = declared_id(ident, data)
        opening = asyncio.gather(*(outcome(self._open_put_artifact(s, declared)) for s in owners))
        unsent: dict[str, bytes] = {}
        try:
            opened = await opening
            unsent.update(
                (s, o.ticket) for s, o in zip(owners, opened, strict=True)
                if not isinstance(o, BaseException)
            )  # fmt: skip
            refusal = self.core.artifact_refusal(list(opened))
            if refusal is not None:
                raise refusal
            deadline, send = self.core.deadlines.stream, self._conn.send_artifact
            sends = [
                outcome(asyncio.to_thread(send, lanes[s], unsent.pop(s), data, deadline))
                for s in list(unsent)
            ]
        finally:
            for shard_id, ticket in unsent.items():  # refused, cancelled, or an error
                await asyncio.to_thread(self._conn.abandon, lanes[shard_id], ticket)
        failed = [o for o in opened if isinstance(o, BaseException)]
        return self.core.artifact_stored(failed + list(await asyncio.gather(*sends)))

    async def _open_put_artifact(self, shard_id: str, declared: pb.ArtifactId) -> pb.TransferTicket:
        async def call(target: str) -> pb.TransferTicket:
            address, idle = self.core.address(target), self.core.deadlines.idle
            try:
                return await self._conn.call(address, "OpenPutArtifact", declared, idle)
            except grpc.RpcError as error:  # a shard stopping meanwhile: the others store it
                gone = stopping(error, target, "OpenPutArtifact")
                if gone is None:
                    raise
                raise gone from error

        return await retrying_async(self.core.attempts([shard_id]), call)

    async def _put_artifact(self, shard_id: str, ident: pb.ArtifactId, data: bytes) -> int:
        async def call(target: str) -> int:
            messages = artifact_messages(ident, data, self.config.message_bytes)
            deadline, address = self.core.deadlines.stream, self.core.address(target)
            response = await self._conn.call(address, "PutArtifact", messages, deadline)
            return response.stored_bytes

        return await retrying_async(self.core.attempts([shard_id]), call)

    async def fetch_artifact(
        self, prefix: CachedPrefix, spec: str, verifier: Verifier | None = None
    ) -> bytes | bytearray | None:
        """As `StoreClient.fetch_artifact`."""
        await self._fresh()
        search = self.core.artifact_search(prefix, spec, verifier)

        async def read(shard_id: str) -> ArtifactReceipt | ReceivedArtifact:
            address, lane = self.core.address(shard_id), self.core.data_address(shard_id)
            deadlines = self.core.deadlines
            if lane is not None:
                ticket = await self._conn.call(
                    address, "OpenFetchArtifact", search.request, deadlines.idle
                )
                receive = self._conn.receive_artifact
                data = await asyncio.to_thread(receive, lane, ticket, deadlines.stream)
                return ReceivedArtifact(data, ticket.signature)
            receipt = ArtifactReceipt()
            async for message in self._conn.call(
                address, "FetchArtifact", search.request, deadlines.stream
            ):
                receipt.add(message)
            return receipt

        for shard_id in search:
            reading = retrying_async(self.core.attempts([shard_id]), read)
            search.take(shard_id, await outcome(reading))
        return search.found

    async def has_artifact(self, prefix: CachedPrefix, spec: str) -> bool:
        """As `StoreClient.has_artifact`."""
        await self._fresh()
        probe = self.core.artifact_probe(prefix, spec)

        async def peek(shard_id: str) -> bool:
            address, deadline = self.core.address(shard_id), self.core.deadlines.call
            call = self._conn.call(address, "FetchArtifact", probe.request, deadline)
            try:
                return await call.read() is not grpc.aio.EOF
            finally:
                call.cancel()

        for shard_id in probe:
            attempts = self.core.attempts([shard_id])
            probe.take(shard_id, await outcome(retrying_async(attempts, peek)))
        return probe.found

    async def delete_prefix(self, tokens, layout: KVLayout, namespace: str = "") -> int:
        """As `StoreClient.delete_prefix`."""
        request = self.core.delete_request(tokens, layout, namespace)
        return sum(response.bytes for response in await self._on_each("Delete", request))

    async def stats(self) -> list[pb.StatsResponse]:
        """As `StoreClient.stats`."""
        return await self._on_each("Stats", pb.StatsRequest())
