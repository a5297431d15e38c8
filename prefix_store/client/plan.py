"""What the sync and async clients share: topology, placement, message building and the
assembly of fetched segments into caller-owned tensors. No I/O here."""

from __future__ import annotations

import hashlib
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.blob import crc32c
from prefix_store.client.arriving import nbytes, pieces
from prefix_store.errors import (
    Aborted,
    CorruptInTransit,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from prefix_store.keys import chunk_keys, parent_keys
from prefix_store.layout import KVLayout
from prefix_store.protocol import wire
from prefix_store.provenance import (
    Proof,
    Signer,
    artifact_statement,
    chunk_statement,
    content_digest,
    content_hasher,
    token_digests,
)

if TYPE_CHECKING:
    import torch


def rendezvous(placement_key: int, shard_ids: Sequence[str], replicas: int) -> list[str]:
    """The `replicas` shards with the highest rendezvous scores for a key, best first.
    Removing a shard only moves the keys it held, to the next shard in their order."""
    key = placement_key.to_bytes(8, "big")

    def score(shard_id: str) -> bytes:
        return hashlib.blake2b(key + shard_id.encode(), digest_size=8).digest()

    return sorted(shard_ids, key=score, reverse=True)[: max(1, replicas)]


@dataclass(frozen=True, slots=True)
class Topology:
    """What Describe said: the caller, its namespaces' salts and the live shards."""

    tenant: str
    salts: dict[str, bytes]
    shards: dict[str, str]
    """shard id -> address"""
    replication: int
    data_addresses: dict[str, str]
    """shard id -> address of its bulk data plane (shards without one are absent)"""
    absent: frozenset[str] = frozenset()
    """Shards of the placement set the last Describe did not list: they keep their chunks'
    placement for a grace period, and calls route around them (see `client.membership`)."""
    attention_kernels: dict[str, str] = field(default_factory=dict)
    """shard id -> the attention kernel it serves Attend with (shards without one are absent)"""
    weight: float = 1.0
    """The tenant's weight in servers' fair shares (decoders and routers share by it)."""
    admin: bool = False
    """Whether the tenant has the admin role (reserved call slots)."""

    @classmethod
    def from_proto(cls, response) -> Topology:
        return cls(
            tenant=response.tenant,
            salts={n.name: n.salt for n in response.namespaces},
            shards={s.shard_id: s.address for s in response.shards},
            replication=max(1, response.replication),
            data_addresses={s.shard_id: s.data_address for s in response.shards if s.data_address},
            attention_kernels={
                s.shard_id: s.attention_kernel for s in response.shards if s.attention_kernel
            },
            weight=response.weight if response.weight > 0 else 1.0,
            admin=response.admin,
        )

    @property
    def live(self) -> list[str]:
        """The shards Describe listed last, sorted."""
        return sorted(s for s in self.shards if s not in self.absent)

    def salt(self, namespace: str) -> bytes:
        if namespace not in self.salts:
            raise NotFound(f"namespace {namespace!r} not found")
        return self.salts[namespace]

    def owners(self, placement_key: int, exclude: frozenset = frozenset()) -> list[str]:
        """Shards holding a chunk, best first, leaving out shards known to have failed."""
        if not self.shards:
            return []
        ranked = rendezvous(placement_key, sorted(self.shards), len(self.shards))
        owners = ranked[: self.replication]
        return [s for s in owners if s not in exclude]


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    index: int
    key: int
    parent: int
    """Placement key: a chunk lives on the owners of its parent key, so every candidate
    last chunk (full or partial) of a prefix is found on the same shards."""
    start: int
    tokens: int
    proof: Proof = field(default=Proof(), compare=False)
    """What the shard said of the chunk's origin (lookups; signed publishes)."""


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """The cached part of a token sequence: what `fetch_layers` and artifacts need."""

    namespace: str
    layout: KVLayout
    tokens: int
    """Leading tokens whose KV the store holds (0 = miss)."""
    chunks: tuple[ChunkPlan, ...]

    @property
    def key(self) -> int:
        """Identifies the whole prefix (its last chunk's chained key); 0 on a miss."""
        return self.chunks[-1].key if self.chunks else 0

    @property
    def bytes(self) -> int:
        return sum(self.layout.chunk_bytes(c.tokens) for c in self.chunks)


def plan_chunks(tokens: Sequence[int], layout: KVLayout, salt: bytes) -> list[ChunkPlan]:
    keys = chunk_keys(tokens, layout, salt)
    parents = parent_keys(keys, layout, salt)
    size = layout.chunk_tokens
    return [
        ChunkPlan(i, k, p, i * size, min(size, len(tokens) - i * size))
        for i, (k, p) in enumerate(zip(keys, parents, strict=True))
    ]


def group_by_owner(
    chunks: Sequence[ChunkPlan], topology: Topology, exclude: frozenset = frozenset()
) -> dict[str, list[ChunkPlan]]:
    """Chunks grouped by their best live owner."""
    groups: dict[str, list[ChunkPlan]] = {}
    for chunk in chunks:
        owners = topology.owners(chunk.parent, exclude)
        if not owners:
            raise NotFound(f"chunk {chunk.index}: no live shard holds it")
        groups.setdefault(owners[0], []).append(chunk)
    return groups


def lanes(groups: dict[str, list], streams: int) -> list[tuple[str, int, list]]:
    """(shard, lane, chunks) streams for a transfer: `streams` spread over the groups, at
    least one per group, each group's chunks in contiguous runs."""
    per_group = max(1, round(streams / max(1, len(groups))))
    return [
        (shard_id, lane, part)
        for shard_id, group in groups.items()
        for lane, part in enumerate(split(group, per_group))
    ]


def split(items: list, parts: int) -> list[list]:
    """`items` in up to `parts` contiguous, nearly equal runs."""
    parts = max(1, min(parts, len(items)))
    step, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + step + (i < extra)
        out.append(items[start:end])
        start = end
    return out


def as_layers(kv, layout: KVLayout, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Normalise a prefix's KV to per-layer (k, v), each [kv_heads, >= tokens, head_dim]."""
    layers = list(kv)
    if len(layers) != layout.num_layers:
        raise InvalidArgument(f"kv: {len(layers)} layers given, layout has {layout.num_layers}")
    out = []
    for i, pair in enumerate(layers):
        k, v = pair[0], pair[1]
        for name, t in (("k", k), ("v", v)):
            if t.dtype != layout.torch_dtype:
                raise InvalidArgument(f"kv[{i}].{name}: dtype {t.dtype}, layout is {layout.dtype}")
            if (
                t.dim() != 3
                or t.shape[0] != layout.num_kv_heads
                or t.shape[2] != layout.head_dim
                or t.shape[1] < tokens
            ):
                raise InvalidArgument(
                    f"kv[{i}].{name}: shape {tuple(t.shape)}, expected "
                    f"[{layout.num_kv_heads}, >={tokens}, {layout.head_dim}]"
                )
        out.append((byte_rows(k), byte_rows(v)))
    return out


def byte_rows(t: torch.Tensor) -> np.ndarray:
    """A KV tensor [kv_heads, tokens, head_dim] as a uint8 array [kv_heads, tokens, row
    bytes] over the same memory (numpy slicing is ~10x cheaper than torch's)."""
    import torch

    return t.detach().cpu().contiguous().view(torch.uint8).numpy()


def segment_views(k: np.ndarray, v: np.ndarray, chunk: ChunkPlan) -> list[memoryview]:
    """One layer of one chunk on the wire is K then V, [kv_heads, tokens, head_dim] each:
    the per-head row blocks of k and v (`byte_rows`), as views."""
    end = chunk.start + chunk.tokens
    return [memoryview(t[h, chunk.start : end]) for t in (k, v) for h in range(t.shape[0])]


def put_header(
    namespace: str, layout: KVLayout, tokens: Sequence[int], chunks: Sequence[ChunkPlan]
) -> pb.PutHeader:
    """The put of `chunks`, with their signatures when they carry signed proofs."""
    end = max(c.start + c.tokens for c in chunks)
    signatures = [c.proof.signature for c in chunks]
    return pb.PutHeader(
        namespace=namespace,
        layout=layout.to_proto(pb),
        token_ids=list(tokens[:end]),
        chunk_indices=[c.index for c in chunks],
        signatures=signatures if all(signatures) else [],
    )


def chunk_digests(layers, chunks: Sequence[ChunkPlan]) -> list[bytes]:
    """Each chunk's content digest over its layer-major segments (what the shard computes)."""
    hashes = [content_hasher() for _ in chunks]
    for k, v in layers:
        for h, chunk in zip(hashes, chunks, strict=True):
            for view in segment_views(k, v, chunk):
                h.update(view)
    return [h.digest() for h in hashes]


def signed_chunks(
    signer: Signer, layout: KVLayout, tokens: Sequence[int], chunks: Sequence[ChunkPlan], layers
) -> list[ChunkPlan]:
    """`chunks` with proofs signed by `signer` (see `prefix_store.provenance`)."""
    ends = [c.start + c.tokens for c in chunks]
    digests = chunk_digests(layers, chunks)
    return [
        replace(c, proof=Proof(d, signer.sign(chunk_statement(layout, t, d))))
        for c, t, d in zip(chunks, token_digests(tokens, ends), digests, strict=True)
    ]


def chunk_crcs(layers, chunks: Sequence[ChunkPlan], crcs: Sequence[int] = ()) -> list[int]:
    """Each chunk's CRC-32C over its layer-major segments (what PutCommit carries), going on
    from `crcs` (each chunk's CRC-32C of the layers before these) when given."""
    crcs = list(crcs) or [0] * len(chunks)
    for k, v in layers:
        for j, chunk in enumerate(chunks):
            for view in segment_views(k, v, chunk):
                crcs[j] = crc32c(view, crcs[j])
    return crcs


def wire_views(k: np.ndarray, v: np.ndarray, chunks: Sequence[ChunkPlan]) -> list[memoryview]:
    """One layer of `chunks` (`byte_rows`) in data-plane wire order: K then V, per head, per
    run of consecutive chunks one contiguous region."""
    return [
        memoryview(t[h, start:end]).cast("B")
        for t in (k, v)
        for h in range(t.shape[0])
        for start, end in runs(chunks)
    ]


def put_messages(
    namespace: str,
    layout: KVLayout,
    tokens: Sequence[int],
    chunks: Sequence[ChunkPlan],
    layers: list[tuple[np.ndarray, np.ndarray]],
    message_bytes: int,
) -> Iterator[bytes]:
    """Serialised PutRequests: the header, layer-major segment batches of about
    `message_bytes`, then the commit with each chunk's CRC-32C over its layer-major bytes."""
    header = put_header(namespace, layout, tokens, chunks)
    yield pb.PutRequest(header=header).SerializeToString()
    batch, size = [], 0
    for layer, (k, v) in enumerate(layers):
        for j, chunk in enumerate(chunks):
            views = segment_views(k, v, chunk)
            batch.append((layer, j, views))
            size += sum(view.nbytes for view in views)
            if size >= message_bytes:
                yield wire.put_segments(batch)
                batch, size = [], 0
    if batch:
        yield wire.put_segments(batch)
    commit = pb.PutCommit(crc32c=chunk_crcs(layers, chunks))
    yield pb.PutRequest(commit=commit).SerializeToString()


def fetch_request(
    prefix: CachedPrefix,
    chunks: Sequence[ChunkPlan],
    layer_start: int,
    layer_end: int,
    message_bytes: int,
) -> pb.FetchRequest:
    return pb.FetchRequest(
        namespace=prefix.namespace,
        layout=prefix.layout.to_proto(pb),
        chunks=[pb.ChunkRef(key=c.key, tokens=c.tokens, digest=c.proof.digest) for c in chunks],
        layer_start=layer_start,
        layer_end=layer_end,
        max_message_bytes=message_bytes,
    )


def rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each head's token rows of a [layers, kv_heads, tokens, head_dim] host tensor
    are one contiguous block (true for slices of a larger staging buffer too), so the data
    plane can receive into them."""
    return t.device.type == "cpu" and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def runs(chunks: Sequence[ChunkPlan]) -> list[tuple[int, int]]:
    """Token ranges covered by maximal runs of consecutive chunks, in order."""
    out: list[list[int]] = []
    for chunk in chunks:
        if out and out[-1][1] == chunk.start:
            out[-1][1] = chunk.start + chunk.tokens
        else:
            out.append([chunk.start, chunk.start + chunk.tokens])
    return [(a, b) for a, b in out]


def corrupt_in_transit(chunk: ChunkPlan, layer: int) -> CorruptInTransit:
    """A fetched segment whose bytes differ from the checksum stored with them: the
    client's failover reads the segment from a replica (or the prefix is a miss)."""
    return CorruptInTransit(
        f"fetch: layer {layer} of chunk {chunk.key:016x} arrived corrupted "
        "(CRC-32C mismatch in transit)"
    )


class Assembly:
    """Fetched segments written into caller-owned `k_out`/`v_out`, each
    [layers in range, kv_heads, >= prefix tokens, head_dim]; tracks complete layers.
    Thread-safe; a segment delivered twice (after a failover) is written again, harmlessly."""

    def __init__(self, prefix: CachedPrefix, k_out, v_out, layer_start: int, layer_end: int):
        layout = prefix.layout
        n = layer_end - layer_start
        for name, t in (("k_out", k_out), ("v_out", v_out)):
            if (
                t.dtype != layout.torch_dtype
                or t.dim() != 4
                or t.shape[0] < n
                or t.shape[1] != layout.num_kv_heads
                or t.shape[2] < prefix.tokens
                or t.shape[3] != layout.head_dim
            ):
                raise InvalidArgument(
                    f"{name}: {t.dtype} {tuple(t.shape)}, expected {layout.dtype} "
                    f"[>={n}, {layout.num_kv_heads}, >={prefix.tokens}, {layout.head_dim}]"
                )
        self.prefix, self.k_out, self.v_out = prefix, k_out, v_out
        self.direct = all(rows_contiguous(t) for t in (k_out, v_out))
        """Whether received bytes can land in the outputs directly (`views`)."""
        self.layer_start, self.layer_end = layer_start, layer_end
        self._done: set[tuple[int, int]] = set()
        self._count = [0] * n
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self.closed = False
        """Set once the consumer gave up: streams stop writing into the outputs."""
        self.bytes = 0
        self.listeners: list = []
        """Called (from any thread) whenever a layer completes or the transfer fails."""

    def apply(self, chunks: Sequence[ChunkPlan], raw: bytes) -> None:
        """Write the segments of one serialised FetchResponse (views, no parse copies)."""
        import torch

        layout = self.prefix.layout
        if self.stopped:
            raise Aborted("fetch: the transfer was cancelled or failed elsewhere")
        for layer, index, data, crc in wire.decode_segments(memoryview(raw)):
            if not (0 <= index < len(chunks) and self.layer_start <= layer < self.layer_end):
                raise InvalidArgument(f"fetch: unexpected segment (layer {layer}, chunk {index})")
            chunk = chunks[index]
            if len(data) != layout.segment_bytes(chunk.tokens):
                raise InvalidArgument(f"fetch: segment of {len(data)} bytes for chunk {index}")
            if crc is None or crc32c(data) != crc:
                raise corrupt_in_transit(chunk, layer)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read
                both = torch.frombuffer(data, dtype=layout.torch_dtype)
            both = both.view(2, layout.num_kv_heads, chunk.tokens, layout.head_dim)
            row = layer - self.layer_start
            end = chunk.start + chunk.tokens
            self.k_out[row, :, chunk.start : end].copy_(both[0])
            self.v_out[row, :, chunk.start : end].copy_(both[1])
            self._mark(row, chunk.index, len(data))

    def layer_regions(
        self, chunks: Sequence[ChunkPlan], layer: int
    ) -> list[tuple[memoryview, list[tuple[int, memoryview]]]]:
        """Where one data-plane layer frame goes, in wire order (K then V, per head, per run
        of consecutive chunks one contiguous writable region), each region with its pieces:
        (position in `chunks`, view) per chunk. A chunk's pieces come in its stored order (K
        heads, then V heads). Needs contiguous outputs."""
        import torch

        row = layer - self.layer_start
        regions = []
        for t in (self.k_out, self.v_out):
            for h in range(t.shape[1]):
                position = 0
                for start, end in runs(chunks):
                    view = memoryview(t[row, h, start:end].view(torch.uint8).numpy()).cast("B")
                    row_bytes, offset, pieces = view.nbytes // (end - start), 0, []
                    while offset < view.nbytes:
                        size = chunks[position].tokens * row_bytes
                        pieces.append((position, view[offset : offset + size]))
                        offset, position = offset + size, position + 1
                    regions.append((view, pieces))
        return regions

    @staticmethod
    def check_layer(
        chunks: Sequence[ChunkPlan], layer: int, got: Sequence[int], crcs: Sequence[int]
    ) -> None:
        """DataLoss unless each chunk's CRC-32C of one received layer (`got`, over its bytes
        in stored order) is its stored one (the layer is then not marked, and a replica's
        copy overwrites it)."""
        for chunk, crc, expected in zip(chunks, got, crcs, strict=True):
            if crc != expected:
                raise corrupt_in_transit(chunk, layer)

    def mark_layer(self, chunks: Sequence[ChunkPlan], layer: int, nbytes: int) -> None:
        """Record that one layer of `chunks` has been written into the outputs."""
        for chunk in chunks:
            self._mark(layer - self.layer_start, chunk.index, nbytes // len(chunks))

    def _mark(self, row: int, chunk_index: int, nbytes: int) -> None:
        with self._cond:
            if (row, chunk_index) in self._done:
                return
            self._done.add((row, chunk_index))
            self.bytes += nbytes
            self._count[row] += 1
            if self._count[row] == len(self.prefix.chunks):
                self._cond.notify_all()
                for listener in self.listeners:
                    listener()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        """Whether streams must stop writing (failed or closed)."""
        return self.closed or self.error is not None

    def first_missing_layer(self, chunks: Sequence[ChunkPlan]) -> int:
        """The first layer (absolute) some of `chunks` still lack."""
        with self._cond:
            for row in range(self.layer_end - self.layer_start):
                if any((row, c.index) not in self._done for c in chunks):
                    return self.layer_start + row
            return self.layer_end

    def layer_ready(self, layer: int) -> bool:
        with self._cond:
            return self._count[layer - self.layer_start] == len(self.prefix.chunks)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = self.error or error
            self._cond.notify_all()
            for listener in self.listeners:
                listener()

    def wait_layer(self, layer: int, timeout: float) -> None:
        """Block until `layer` is complete; re-raise the transfer's failure."""
        row = layer - self.layer_start
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self.error is not None or self._count[row] == len(self.prefix.chunks),
                timeout,
            )
            if self.error is not None:
                raise self.error
            if not ok:
                raise Unavailable(f"fetch: layer {layer} did not arrive within {timeout:.0f} s")


@dataclass(frozen=True, slots=True)
class Settled:
    """The outcome of a publish's put streams."""

    stored_bytes: int
    done: list[tuple[str, list[int]]]
    """(shard, keys it newly stored) of every stream that committed: what an undo deletes."""
    missing_replicas: int
    error: Exception | None
    """Why the publish failed (then it must be undone), or None."""


def settle(chunks, outcomes, replication: int) -> Settled:
    """outcomes: (shard id, chunks of the stream, PutResponse or the StoreError it raised).
    A failure other than an unavailable replica (quota, bad input), or a chunk left with no
    copy, fails the whole publish."""
    stored, placed, failures, done = 0, {c.index: 0 for c in chunks}, [], []
    for shard_id, part, outcome in outcomes:
        if isinstance(outcome, Exception):
            failures.append(outcome)
            continue
        stored += outcome.stored_bytes
        done.append((shard_id, list(outcome.new_keys)))
        for chunk in part:
            placed[chunk.index] += 1
    fatal = [f for f in failures if not isinstance(f, Unavailable)]
    error = None
    if fatal or any(n == 0 for n in placed.values()):
        error = (fatal or failures or [Unavailable("publish: a chunk found no shard")])[0]
    missing = sum(max(0, replication - n) for n in placed.values())
    return Settled(stored, done, missing, error)


def lookup_request(
    ids: list[int], layout: KVLayout, namespace: str, chunks: Sequence[ChunkPlan]
) -> pb.LookupRequest:
    """The Lookup of `chunks` (all on the same owners) of the token sequence `ids`."""
    end = max(c.start + c.tokens for c in chunks)
    return pb.LookupRequest(
        namespace=namespace,
        layout=layout.to_proto(pb),
        token_ids=ids[:end],
        chunk_indices=[c.index for c in chunks],
    )


def held_chunks(
    group: Sequence[ChunkPlan], response: pb.LookupResponse
) -> tuple[dict[int, ChunkPlan], set[int]]:
    """What one owner's Lookup of `group` said: chunk index -> the chunk as that owner holds
    it (whole, or the longest stored partial chunk that starts it), and the indices it
    answered for (those it holds, and the first it lacks: a shard stops there)."""
    present = set(response.present)
    proofs = dict(zip(response.present, response.proofs, strict=False))
    held: dict[int, ChunkPlan] = {}
    answered: set[int] = set()
    for chunk in sorted(group, key=lambda c: c.index):
        answered.add(chunk.index)
        if chunk.index in present:
            held[chunk.index] = replace(chunk, proof=proof_of(proofs.get(chunk.index)))
            continue
        if response.partial_tokens and response.partial_index == chunk.index:
            held[chunk.index] = ChunkPlan(
                chunk.index,
                response.partial_key,
                chunk.parent,
                chunk.start,
                response.partial_tokens,
                proof_of(response.partial_proof),
            )
        break
    return held, answered


def cached_prefix(
    namespace: str, layout: KVLayout, chunks: Sequence[ChunkPlan], found: dict[int, ChunkPlan]
) -> CachedPrefix:
    """The leading chunks found whole (`found`: chunk index -> the chunk as held), plus the
    partial chunk found where they stop, if any."""
    cached: list[ChunkPlan] = []
    for chunk in chunks:
        held = found.get(chunk.index)
        if held is None:
            break
        cached.append(held)
        if held.tokens < chunk.tokens:
            break
    return CachedPrefix(namespace, layout, sum(c.tokens for c in cached), tuple(cached))


def proof_of(message: pb.ChunkProof | None) -> Proof:
    if message is None:
        return Proof()
    return Proof(message.digest, message.signature)


def placement(chunks: Sequence[ChunkPlan], topology) -> dict[str, list[ChunkPlan]]:
    """Every owner of every chunk -> its chunks (what a publish sends where)."""
    out: dict[str, list[ChunkPlan]] = {}
    for chunk in chunks:
        for shard_id in topology.owners(chunk.parent):
            out.setdefault(shard_id, []).append(chunk)
    return out


def artifact_id(prefix: CachedPrefix, spec: str, signature: bytes = b"") -> pb.ArtifactId:
    return pb.ArtifactId(
        namespace=prefix.namespace,
        layout=prefix.layout.to_proto(pb),
        prefix_key=prefix.key,
        prefix_tokens=prefix.tokens,
        compressor=spec,
        signature=signature,
    )


def artifact_statement_of(prefix: CachedPrefix, spec: str, data: bytes) -> bytes:
    """What a decoder signs for an artifact of `prefix` (see `prefix_store.provenance`)."""
    digest = content_digest([data])
    return artifact_statement(prefix.layout, prefix.key, prefix.tokens, spec, digest)


def declared_id(ident: pb.ArtifactId, data) -> pb.ArtifactId:
    """`ident` declaring the size of `data` (what PutArtifact and OpenPutArtifact send
    first)."""
    declared = pb.ArtifactId()
    declared.CopyFrom(ident)
    declared.size = nbytes(data)
    return declared


def artifact_messages(ident: pb.ArtifactId, data: bytes, step: int) -> Iterator:
    """PutArtifact's stream: the id (declaring the size), the data in `step`-byte messages
    (from an `Arriving` buffer as its bytes come), the checksum."""
    yield pb.PutArtifactRequest(id=declared_id(ident, data))
    crc = 0
    for _, piece in pieces(data, step):
        crc = crc32c(piece, crc)
        yield pb.PutArtifactRequest(data=bytes(piece))
    yield pb.PutArtifactRequest(crc32c=crc)


@dataclass(frozen=True, slots=True)
class ReceivedArtifact:
    """An artifact received over the data plane, its CRC-32C already checked on arrival;
    read as an `ArtifactReceipt` is (`data()`, `signature`)."""

    payload: bytearray
    signature: bytes

    def data(self) -> bytearray:
        return self.payload


class ArtifactReceipt:
    """A FetchArtifact stream as it arrives: the data, the signature (carried by the first
    message) and the checksum (by the last)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.crc: int | None = None
        self.signature = b""

    def add(self, message: pb.FetchArtifactResponse) -> None:
        self.parts.append(message.data)
        self.crc = message.crc32c
        self.signature = self.signature or message.signature

    def data(self) -> bytes:
        """The artifact's bytes; DataLoss when they differ from the checksum sent."""
        data = b"".join(self.parts)
        if self.crc is None or crc32c(data) != self.crc:
            raise CorruptInTransit("fetch_artifact: the artifact arrived corrupted")
        return data
