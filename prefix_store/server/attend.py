"""Near-data attention on a shard: the server side of `Attend` (see the .proto).

A decoder sends, per layer, the query rows of a verification pass; the shard answers with
attention partials over the full chunks it holds of the prefix (`near_data.chunk_partials`,
the kernel the decoder folds them with), so the chunks' KV never leaves the shard.

`AttendSession` is one stream: its chunks are leased from the header until it closes, each
query reads the layer's segments (memory or disk tier, checked against their stored
CRC-32C: a corrupt one is `DataLoss`; layers held in memory once per stream, layers on disk
at every read) and views them as tensors without copying. Sessions know nothing about
gRPC or tenants: the `Attend` method (`AttendMethod`) checks the caller and passes a
namespace.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field

import torch
from vericache.v1 import prefix_store_pb2 as pb

from numerics.cpu import partials as near_data
from prefix_store import faults
from prefix_store.blob import crc32c
from prefix_store.errors import InvalidArgument, KernelMismatch
from prefix_store.layout import KVLayout
from prefix_store.namespace import Namespace
from prefix_store.protocol.attend import FLOAT32, MAX_CHUNKS, MAX_QUERY_HEADS, MAX_ROWS
from prefix_store.server.requests import layout_of
from prefix_store.shard import ChunkRef, FetchStream, Shard
from rpc.handler import streaming
from rpc.limits import TenantSlots
from rpc.server import client_stream


def kernel_fingerprint(enabled: bool = True) -> str:
    """The kernel this process computes partials with ("" = none: Attend is refused)."""
    return near_data.kernel_fingerprint() if enabled else ""


def short(fingerprint: str) -> str:
    """A fingerprint as error messages name it (truncated; "none" when empty)."""
    return repr(fingerprint[:16]) if fingerprint else "none"


def check_kernel(theirs: str, ours: str) -> None:
    if not ours:
        raise KernelMismatch("attend: this shard has no fused attention kernel; fetch the KV")
    if theirs != ours:
        raise KernelMismatch(
            f"attend: header.kernel {short(theirs)} is not this shard's kernel {short(ours)}; "
            "fetch the KV instead"
        )


def check_geometry(layout: KVLayout, heads: int) -> None:
    """What the kernel computes on: float32, head_dim and chunk_tokens multiples of 8, GQA
    heads."""
    if layout.dtype != "float32":
        raise InvalidArgument(f"header.layout.dtype: {layout.dtype!r}; Attend needs float32")
    for name in ("head_dim", "chunk_tokens"):
        if getattr(layout, name) % 8:
            raise InvalidArgument(
                f"header.layout.{name}: {getattr(layout, name)} is not a multiple of 8 (Attend)"
            )
    if not 1 <= heads <= MAX_QUERY_HEADS or heads % layout.num_kv_heads:
        raise InvalidArgument(
            f"header.heads: {heads} is not a multiple of layout.num_kv_heads "
            f"({layout.num_kv_heads}) in [1, {MAX_QUERY_HEADS}]"
        )


def chunk_refs(header: pb.AttendHeader, layout: KVLayout) -> list[ChunkRef]:
    """The header's chunks: 1 to MAX_CHUNKS, every one full."""
    if not 0 < len(header.chunks) <= MAX_CHUNKS:
        raise InvalidArgument(f"header.chunks: between 1 and {MAX_CHUNKS} required")
    for index, chunk in enumerate(header.chunks):
        if chunk.tokens != layout.chunk_tokens:
            raise InvalidArgument(
                f"header.chunks[{index}].tokens: {chunk.tokens}; Attend takes full chunks "
                f"only ({layout.chunk_tokens} tokens)"
            )
    return [ChunkRef(c.key, c.tokens, c.digest) for c in header.chunks]


def tensor_of(buffer, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
    """A float32 view of `buffer` (read-only bytes: the kernel only reads it), no copy."""
    count = 1
    for size in shape:
        count *= size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: we only read
        flat = torch.frombuffer(buffer, dtype=torch.float32, count=count, offset=offset)
    return flat.view(shape)


def as_bytes(t: torch.Tensor) -> bytes:
    """A float32 tensor's bytes, little endian, in C order."""
    return t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


@dataclass(slots=True)
class AttendStats:
    """What Attend did on a shard, for operators (`shard_stats`). Thread-safe."""

    streams: int = 0
    queries: int = 0
    rows: int = 0
    bytes_in: int = 0
    """Query bytes received."""
    bytes_out: int = 0
    """Partials bytes sent."""
    compute_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def opened(self) -> None:
        with self._lock:
            self.streams += 1

    def answered(self, rows: int, bytes_in: int, bytes_out: int, seconds: float) -> None:
        with self._lock:
            self.queries += 1
            self.rows += rows
            self.bytes_in += bytes_in
            self.bytes_out += bytes_out
            self.compute_s += seconds

    def figures(self) -> dict:
        with self._lock:
            return {
                "attend_streams": self.streams,
                "attend_queries": self.queries,
                "attend_rows": self.rows,
                "attend_bytes_in": self.bytes_in,
                "attend_bytes_out": self.bytes_out,
                "attend_compute_s": round(self.compute_s, 6),
            }


class AttendSession:
    """One Attend stream over leased chunks: `answer` each query, `close` once (idempotent:
    releases the leases)."""

    def __init__(
        self, stream: FetchStream, layout: KVLayout, heads: int, max_response_bytes: int
    ) -> None:
        self.stream, self.layout, self.heads = stream, layout, heads
        self.max_response_bytes = max_response_bytes
        self.chunks = len(stream.blobs)
        self._checked: dict[int, list] = {}
        """Layers whose segments were all in memory when read: checked once, kept."""

    def answer(self, query: pb.AttendQuery) -> pb.AttendResponse:
        start = time.perf_counter()
        q = self._query(query)  # [T, H, D]
        keys, values = self._layer(query.layer)  # each [KVH, n, D] per chunk
        partials = near_data.chunk_partials(q, keys, values)
        m, denom, acc = (as_bytes(t) for t in (partials.m, partials.l, partials.acc))
        crc = crc32c(acc, crc32c(denom, crc32c(m)))
        m, denom, acc = (bytes(b) for b in faults.ATTEND.tamper([m, denom, acc]))
        return pb.AttendResponse(
            layer=query.layer,
            m=m,
            l=denom,
            acc=acc,
            crc32c=crc,
            compute_s=time.perf_counter() - start,
        )

    def response_bytes(self, rows: int) -> int:
        """Bytes of the partials of `rows` rows: m and l [C, T, H], acc [C, T, H, D]."""
        return self.chunks * rows * self.heads * (self.layout.head_dim + 2) * FLOAT32

    def _query(self, query: pb.AttendQuery) -> torch.Tensor:
        layout, rows = self.layout, query.rows
        if not 0 <= query.layer < layout.num_layers:
            raise InvalidArgument(f"query.layer: {query.layer} is not in [0, {layout.num_layers})")
        if not 1 <= rows <= MAX_ROWS:
            raise InvalidArgument(f"query.rows: {rows} is not in [1, {MAX_ROWS}]")
        expected = rows * self.heads * layout.head_dim * FLOAT32
        if len(query.q) != expected:
            raise InvalidArgument(
                f"query.q: {len(query.q)} bytes; expected {expected} (rows {rows} x heads "
                f"{self.heads} x head_dim {layout.head_dim} float32)"
            )
        if self.response_bytes(rows) > self.max_response_bytes:
            raise InvalidArgument(
                f"query.rows: the partials of {rows} rows over {self.chunks} chunks take "
                f"{self.response_bytes(rows)} bytes, over the message limit of "
                f"{self.max_response_bytes}; send fewer rows or fewer chunks per stream"
            )
        return tensor_of(query.q, (rows, self.heads, layout.head_dim))

    def _layer(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each chunk's K and V of `layer`, [KVH, n, D] views of its checked segment."""
        layout = self.layout
        shape = (layout.num_kv_heads, layout.chunk_tokens, layout.head_dim)
        half = layout.half_bytes(layout.chunk_tokens)
        segments = self._segments(layer)
        keys = [tensor_of(s, shape) for s in segments]
        values = [tensor_of(s, shape, offset=half) for s in segments]
        return keys, values

    def _segments(self, layer: int) -> list:
        """The layer's segments, checked against their CRC-32C: at the stream's first read
        of the layer when every chunk is in memory (the leased bytes are kept, so later
        queries skip the pass), at every read when some chunk is on disk (re-read)."""
        segments = self._checked.get(layer)
        if segments is None:
            segments = self.stream.layer(layer)
            if all(blob.data is not None for blob in self.stream.blobs):
                self._checked[layer] = segments
        return segments

    def close(self) -> None:
        self.stream.close()


def open_session(
    shard: Shard,
    namespace: Namespace,
    layout: KVLayout,
    header: pb.AttendHeader,
    kernel: str,
    max_response_bytes: int,
) -> AttendSession:
    """Check the header (geometry, chunks, kernel) and lease its chunks (NotFound when one
    is not held here with the digest asked for)."""
    check_geometry(layout, header.heads)
    refs = chunk_refs(header, layout)
    check_kernel(header.kernel, kernel)
    stream = shard.open_fetch(namespace, layout, refs, 0, layout.num_layers)
    return AttendSession(stream, layout, header.heads, max_response_bytes)


class AttendMethod:
    """The Attend method: a stream per session, at most `max_attend_streams_per_tenant` of
    a tenant's at once."""

    def __init__(self, service) -> None:
        self.service = service
        self.gate = service.gate
        self.slots = TenantSlots(service.config.max_attend_streams_per_tenant, "Attend streams")

    @streaming
    def Attend(self, requests, call):
        """Near-data attention (see `prefix_store.attend`): the header leases its chunks,
        then each query is answered with the partials over them, in order."""
        with self.slots.admit(call.caller.name):
            messages = client_stream(requests)
            session = self._begin_attend(next(messages, None), call)
            self.service.attend_stats.opened()
            try:
                for message in messages:
                    yield self._answer(session, message)
            finally:
                session.close()

    def _begin_attend(self, first, call) -> AttendSession:
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgument("attend: the first message must be the header")
        header = first.header
        _, space = self.service.caller(call, header.namespace)
        return open_session(
            self.service.shard,
            space,
            layout_of(header),
            header,
            self.service.kernel,
            self.service.config.max_message_bytes,
        )

    def _answer(self, session: AttendSession, message) -> pb.AttendResponse:
        if message.WhichOneof("kind") != "query":
            raise InvalidArgument("attend: after the header, only queries may come")
        response = session.answer(message.query)
        self.service.attend_stats.answered(
            message.query.rows,
            len(message.query.q),
            len(response.m) + len(response.l) + len(response.acc),
            response.compute_s,
        )
        return response
