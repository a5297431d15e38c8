"""The asyncio client SDK: the same operations and guarantees as `StoreClient`, on grpc.aio.

Use `await AsyncStoreClient.connect(endpoints, token)`. Fetches stream into caller-owned
tensors with the same failover (a failed stream resumes on a replica from its first
incomplete layer); `iter_layers` is an async generator of completed layer indices.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Sequence

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
)
from prefix_store.client.retry import retrying_async, rpc_error
from prefix_store.client.sync import (
    FETCH_METHOD,
    PUT_METHOD,
    PublishResult,
    _same,
    artifact_placement,
    channel_options,
    data_plane_tls,
    exhausted,
    failover_error,
)
from prefix_store.client.transfer import receive, send_put
from prefix_store.config import ClientConfig
from prefix_store.data_plane import redemption
from prefix_store.errors import InvalidArgument, NotFound, StoreError, Unavailable
from prefix_store.layout import KVLayout
from prefix_store.shard import validate_tokens
from prefix_store.status import FAILOVER
from prefix_store.tls import make_aio_channel

log = logging.getLogger(__name__)


class Cancels:
    """Data-plane transfers of one fetch; one registered after `cancel_all` is cut at once."""

    def __init__(self) -> None:
        self._items: list = []
        self._lock = threading.Lock()
        self.cancelled = False

    def track(self, item) -> None:
        with self._lock:
            self._items.append(item)
            if self.cancelled:
                item.cancel()

    def cancel_all(self) -> None:
        with self._lock:
            self.cancelled = True
            for item in self._items:
                item.cancel()


class AsyncStoreClient:
    def __init__(self, endpoints, token: str, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise InvalidArgument("endpoints: at least one host:port is required")
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._token = token
        self._channels: dict[tuple[str, int], grpc.aio.Channel] = {}
        self._data_tls = data_plane_tls(self.config)
        self.topology: Topology | None = None

    @classmethod
    async def connect(cls, endpoints, token: str, config: ClientConfig | None = None):
        client = cls(endpoints, token, config)
        await client.describe()
        return client

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def __aenter__(self) -> AsyncStoreClient:
        if self.topology is None:
            await self.describe()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _channel(self, address: str, lane: int = 0) -> grpc.aio.Channel:
        channel = self._channels.get((address, lane))
        if channel is None:
            channel = make_aio_channel(address, channel_options(self.config), self.config.tls)
            self._channels[(address, lane)] = channel
        return channel

    def _stub(self, address: str, lane: int = 0) -> pb_grpc.PrefixStoreStub:
        return pb_grpc.PrefixStoreStub(self._channel(address, lane))

    def _address(self, shard_id: str) -> str:
        return self.topology.shards[shard_id]

    async def describe(self) -> Topology:
        known = list(self.topology.shards.values()) if self.topology else []
        targets = list(dict.fromkeys(self.endpoints + known))
        response = await retrying_async(
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

    async def _unary(self, shard_ids: Sequence[str], method: str, request):
        async def call(shard_id: str):
            stub = self._stub(self._address(shard_id))
            return await getattr(stub, method)(
                request, metadata=self._metadata, timeout=self.config.timeout_s
            )

        return await retrying_async(self.config, list(shard_ids), call)

    # ---- lookup ---------------------------------------------------------------------------

    async def lookup(
        self, tokens: Sequence[int], layout: KVLayout, namespace: str = ""
    ) -> CachedPrefix:
        """The longest cached prefix of `tokens` in `namespace` (tokens == 0 on a miss)."""
        ids = validate_tokens(tokens)
        chunks = plan_chunks(ids, layout, self.topology.salt(namespace))
        if not chunks:
            return CachedPrefix(namespace, layout, 0, ())
        planned = lookup_requests(ids, layout, namespace, chunks, self.topology)
        responses = await asyncio.gather(
            *(self._unary(owners, "Lookup", request) for owners, request, _ in planned)
        )
        answers = {
            c.index: response
            for (_, _, group), response in zip(planned, responses, strict=True)
            for c in group
        }
        return cached_prefix(namespace, layout, chunks, answers)

    # ---- publish --------------------------------------------------------------------------

    async def publish_prefix(
        self, tokens: Sequence[int], kv, layout: KVLayout, namespace: str = ""
    ) -> PublishResult:
        ids = validate_tokens(tokens)
        if not ids:
            raise InvalidArgument("tokens: at least one token is required")
        layers = as_layers(kv, layout, len(ids))
        chunks = plan_chunks(ids, layout, self.topology.salt(namespace))
        streams = lanes(placement(chunks, self.topology), self.config.streams)
        jobs = []
        for shard_id, lane, part in streams:
            put = self._put(shard_id, lane, namespace, layout, ids, part, layers)
            jobs.append((shard_id, part, put))
        results = await asyncio.gather(*(job for _, _, job in jobs), return_exceptions=True)
        outcomes = []
        for (shard_id, part, _), result in zip(jobs, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, StoreError):
                raise result
            outcomes.append((shard_id, part, result))
        settled = settle(chunks, outcomes, self.topology.replication)
        if settled.error is not None:
            for shard_id, keys in settled.done:
                if not keys:
                    continue
                request = pb.DeleteRequest(namespace=namespace, chunk_keys=keys)
                try:
                    await self._unary([shard_id], "Delete", request)
                except StoreError as error:  # best effort: the chunks are valid data
                    log.warning(
                        "publish: could not undo %d chunks on %s: %s", len(keys), shard_id, error
                    )
            raise settled.error
        prefix = CachedPrefix(namespace, layout, len(ids), tuple(chunks))
        return PublishResult(prefix, settled.stored_bytes, settled.missing_replicas)

    async def _put(self, shard_id, lane, namespace, layout, ids, chunks, layers) -> int:
        async def call(target: str) -> int:
            if self.config.data_plane and target in self.topology.data_addresses:
                header = put_header(namespace, layout, ids, chunks)
                ticket = await self._stub(self._address(target)).OpenPut(
                    header, metadata=self._metadata, timeout=self.config.timeout_s
                )
                return await asyncio.to_thread(
                    send_put,
                    self.topology.data_addresses[target],
                    redemption(ticket.ticket, self._token),
                    layout,
                    chunks,
                    layers,
                    self.config.stream_timeout_s,
                    self._data_tls,
                )
            put = self._channel(self._address(target), lane).stream_unary(
                PUT_METHOD,
                request_serializer=_same,
                response_deserializer=pb.PutResponse.FromString,
            )
            messages = put_messages(
                namespace, layout, ids, chunks, layers, self.config.message_bytes
            )
            return await put(
                iter(messages), metadata=self._metadata, timeout=self.config.stream_timeout_s
            )

        return await retrying_async(self.config, [shard_id], call)

    # ---- fetch ----------------------------------------------------------------------------

    async def iter_layers(
        self, prefix: CachedPrefix, k_out, v_out, layer_start: int = 0, layer_end: int | None = None
    ) -> AsyncIterator[int]:
        """Stream layers into `k_out`/`v_out` (as `StoreClient.start_fetch`), yielding each
        layer index once it is complete."""
        layer_end = prefix.layout.num_layers if layer_end is None else layer_end
        if not 0 <= layer_start < layer_end <= prefix.layout.num_layers:
            raise InvalidArgument(f"layers: [{layer_start}, {layer_end}) out of range")
        if not prefix.chunks:
            raise NotFound("fetch: the prefix has no cached chunks")
        assembly = Assembly(prefix, k_out, v_out, layer_start, layer_end)
        progress = asyncio.Event()
        loop = asyncio.get_running_loop()
        assembly.listeners.append(lambda: loop.call_soon_threadsafe(progress.set))
        tasks: set[asyncio.Task] = set()
        cancels = Cancels()

        def spread(chunks, layer_from: int, failed: frozenset, cause=None) -> None:
            try:
                groups = group_by_owner(chunks, self.topology, failed)
            except NotFound as error:
                assembly.fail(exhausted(error, failed, cause))
                progress.set()
                return
            if layer_from >= layer_end or assembly.stopped:
                return
            for shard_id, lane, part in lanes(groups, self.config.streams):
                task = asyncio.ensure_future(stream(shard_id, lane, part, layer_from, failed))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        async def stream(shard_id, lane, chunks, layer_from, failed) -> None:
            request = fetch_request(
                prefix, chunks, layer_from, layer_end, self.config.message_bytes
            )
            try:
                if (
                    self.config.data_plane
                    and assembly.direct
                    and (shard_id in self.topology.data_addresses)
                ):
                    await self._stream_data_plane(shard_id, request, assembly, chunks, cancels)
                else:
                    await self._stream_grpc(shard_id, lane, request, assembly, chunks)
            except Exception as error:  # noqa: BLE001 - every failure ends in the assembly
                cause = failover_error(error)
                if cause is None:
                    assembly.fail(rpc_error(error) if isinstance(error, grpc.RpcError) else error)
                else:
                    resume = assembly.first_missing_layer(chunks)
                    spread(chunks, resume, failed | {shard_id}, cause)
            progress.set()

        spread(list(prefix.chunks), layer_start, frozenset())
        try:
            for layer in range(layer_start, layer_end):
                while not assembly.layer_ready(layer):
                    if assembly.error is not None:
                        raise assembly.error
                    if not tasks:
                        raise Unavailable(f"fetch: layer {layer} never arrived")
                    progress.clear()
                    try:
                        await asyncio.wait_for(progress.wait(), self.config.stream_timeout_s)
                    except TimeoutError as error:
                        raise Unavailable(
                            f"fetch: layer {layer} did not arrive within "
                            f"{self.config.stream_timeout_s:.0f} s"
                        ) from error
                yield layer
        finally:
            # Cut the streams, then wait for them: nothing may write into the outputs after.
            assembly.close()
            cancels.cancel_all()
            if tasks:
                await asyncio.wait(list(tasks), timeout=self.config.timeout_s)
            for task in list(tasks):
                task.cancel()

    async def _stream_grpc(self, shard_id, lane, request, assembly, chunks) -> None:
        fetch = self._channel(self._address(shard_id), lane).unary_stream(
            FETCH_METHOD,
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=_same,
        )
        async for raw in fetch(
            request, metadata=self._metadata, timeout=self.config.stream_timeout_s
        ):
            assembly.apply(chunks, raw)

    async def _stream_data_plane(self, shard_id, request, assembly, chunks, cancels) -> None:
        ticket = await self._stub(self._address(shard_id)).OpenFetch(
            request, metadata=self._metadata, timeout=self.config.timeout_s
        )
        address = self.topology.data_addresses[shard_id]
        await asyncio.to_thread(
            receive,
            address,
            redemption(ticket.ticket, self._token),
            assembly,
            chunks,
            request.layer_start,
            self.config.timeout_s,
            cancels.track,
            self._data_tls,
        )

    async def fetch_layers(self, prefix, k_out, v_out, layer_start=0, layer_end=None) -> int:
        """Stream all requested layers into the outputs; returns the bytes received."""
        async for _ in self.iter_layers(prefix, k_out, v_out, layer_start, layer_end):
            pass
        end = prefix.layout.num_layers if layer_end is None else layer_end
        return sum(prefix.layout.segment_bytes(c.tokens) for c in prefix.chunks) * (
            end - layer_start
        )

    # ---- artifacts, delete, stats ---------------------------------------------------------

    async def put_artifact(self, prefix: CachedPrefix, spec: str, data: bytes) -> int:
        ident = artifact_id(prefix, spec)
        step = self.config.message_bytes

        async def put(shard_id: str) -> int:
            async def call(target: str) -> int:
                stub = self._stub(self._address(target))
                response = await stub.PutArtifact(
                    artifact_messages(ident, data, step),
                    metadata=self._metadata,
                    timeout=self.config.stream_timeout_s,
                )
                return response.stored_bytes

            return await retrying_async(self.config, [shard_id], call)

        owners = self.topology.owners(artifact_placement(prefix.key, spec))
        results = await asyncio.gather(*(put(s) for s in owners), return_exceptions=True)
        if all(isinstance(r, BaseException) for r in results):
            raise results[0]
        return sum(r for r in results if not isinstance(r, BaseException))

    async def fetch_artifact(self, prefix: CachedPrefix, spec: str) -> bytes | None:
        request = pb.FetchArtifactRequest(
            id=artifact_id(prefix, spec), max_message_bytes=self.config.message_bytes
        )
        for shard_id in self.topology.owners(artifact_placement(prefix.key, spec)):
            stub = self._stub(self._address(shard_id))
            try:
                parts, crc = [], None
                async for message in stub.FetchArtifact(
                    request, metadata=self._metadata, timeout=self.config.stream_timeout_s
                ):
                    parts.append(message.data)
                    crc = message.crc32c  # carried by the last message
            except grpc.RpcError as error:
                if error.code() in FAILOVER:
                    continue
                raise rpc_error(error) from error
            data = b"".join(parts)
            if crc is not None and crc32c(data) == crc:
                return data
        return None

    async def delete_prefix(self, tokens, layout: KVLayout, namespace: str = "") -> int:
        request = pb.DeleteRequest(
            namespace=namespace, layout=layout.to_proto(pb), token_ids=validate_tokens(tokens)
        )
        responses = await asyncio.gather(
            *(self._unary([s], "Delete", request) for s in self.topology.shards)
        )
        return sum(r.bytes for r in responses)

    async def stats(self) -> list[pb.StatsResponse]:
        return list(
            await asyncio.gather(
                *(
                    self._unary([s], "Stats", pb.StatsRequest())
                    for s in sorted(self.topology.shards)
                )
            )
        )
