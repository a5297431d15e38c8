"""Puts: a two-phase put of chunks (`PutSession`: segments staged privately, then
committed), and the commit that makes checked blobs visible, all or none."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from prefix_store.blob import Blob
from prefix_store.data_plane import head_major_pieces
from prefix_store.errors import InvalidArgument, StoreFull
from prefix_store.keys import chunk_keys, parent_keys
from prefix_store.namespace import Namespace
from prefix_store.provenance import PROOF_FORMAT, Verifier, chunk_statement, token_digests
from prefix_store.shard.arrival import ArrivalCheck
from prefix_store.shard.blobs import chunk_id, chunk_tokens, is_signed
from prefix_store.shard.usage import QuotaCheck, check_quota

if TYPE_CHECKING:
    from prefix_store.shard.holdings import Holdings


@dataclass(frozen=True, slots=True)
class Committed:
    keys: list[int]
    """Every key of the put (chunks that were already stored included)."""
    new_bytes: int
    new_keys: list[int]
    """Keys this put stored: what undoing it must delete."""


def check_signature(
    verifier: Verifier | None, statement: bytes, signature: bytes, what: str
) -> bool:
    """Whether a put's signature was checked (True) or there was none / no key to check it
    with (False); a signature that fails the check refuses the put."""
    if not signature or verifier is None:
        return False
    if not verifier.verify(statement, signature):
        raise InvalidArgument(f"{what}: the signature does not verify for these bytes")
    return True


def new_bytes(
    holdings: Holdings, namespace: Namespace, keys: Sequence[int], sizes: Sequence[int]
) -> int:
    """Bytes a put of these chunks would add (chunks already stored cost nothing)."""
    with holdings.lock:
        return sum(
            size
            for key, size in zip(keys, sizes, strict=True)
            if holdings.find_live(chunk_id(namespace, key)) is None
        )


def commit(holdings: Holdings, blobs: list[Blob], owner: str, quota: QuotaCheck) -> Committed:
    """As `Shard.commit`."""
    allowance = quota(owner)
    placement = holdings.placement
    with holdings.mutating() as failed:
        holdings.leases.refuse_doomed(blobs)
        stale = [placement.find(b.id) for b in blobs if _replaces(holdings, b)]
        holdings.leases.refuse_leased([old.id for old in stale])
        replaced = {old.id for old in stale}
        new = [b for b in blobs if b.id in replaced or placement.find(b.id) is None]
        new_bytes = sum(b.nbytes for b in new)
        freed = sum(old.nbytes for old in stale)
        own_freed = sum(old.nbytes for old in stale if old.owner == owner)
        check_quota(holdings.stats.usage, owner, allowance, max(0, new_bytes - own_freed))
        if not placement.room_for(max(0, new_bytes - freed)):
            raise StoreFull(
                f"shard {holdings.shard_id}: no room for {new_bytes} bytes "
                f"(memory {placement.memory.used}/{placement.memory.capacity}, "
                f"disk {placement.disk.used}/{placement.disk.capacity})"
            )
        for old in stale:
            holdings.drop(old.id)
        for blob in new:
            holdings.place(blob)
        for blob in blobs:
            holdings.claims.claim(blob.id, owner)
        holdings.stats.received_bytes += sum(b.nbytes for b in blobs)
        holdings.stats.stored_bytes += new_bytes
    holdings.settle_change(failed, new)
    return Committed([b.id[2] for b in blobs], new_bytes, [b.id[2] for b in new])


def _replaces(holdings: Holdings, blob: Blob) -> bool:
    """Whether `blob`, signed, replaces an unsigned one of its key."""
    old = holdings.placement.find(blob.id)
    return old is not None and is_signed(blob) and not is_signed(old)


class PutSession:
    """One two-phase put: segments are staged privately; `commit` checks and publishes.

    Each chunk's bytes land in one buffer of its own, allocated when its first segment
    arrives and holding exactly the chunk: a received message is copied out of, never kept
    (its unknown fields or padding pin nothing), and every byte buffered is first held in
    the owner's share of the receive budget (`Reservation.grow`). Each chunk's CRCs and
    digest are computed as its bytes land (`ArrivalCheck`), so the commit reads no byte
    again."""

    def __init__(
        self, shard, namespace, layout, ids, indices, owner, quota, signatures, weight=None
    ) -> None:
        self.shard, self.namespace, self.layout = shard, namespace, layout
        self.owner, self.quota = owner, quota
        keys = chunk_keys(ids, layout, namespace.salt)
        if len(indices) > len(keys):
            raise InvalidArgument(f"header.chunk_indices: more than the {len(keys)} chunks")
        self.indices = list(indices)
        self._check_indices(len(keys))
        self.signatures = self._check_signatures(signatures)
        parents = parent_keys(keys, layout, namespace.salt)
        self.tokens = [chunk_tokens(ids, layout, i) for i in self.indices]
        ends = [min((i + 1) * layout.chunk_tokens, len(ids)) for i in self.indices]
        self.token_digests = token_digests(ids, ends) if self.signatures else []
        self.keys = [keys[i] for i in self.indices]
        self.parents = [parents[i] for i in self.indices]
        total = sum(layout.chunk_bytes(len(t)) for t in self.tokens)
        if total > shard.config.max_put_bytes:
            raise InvalidArgument(
                f"put: {total} bytes exceed the per-put limit of {shard.config.max_put_bytes}"
            )
        sizes = [layout.chunk_bytes(len(t)) for t in self.tokens]
        new = shard.new_bytes(namespace, self.keys, sizes)
        self.reservation = shard.reserve(owner, quota(owner), total, new, weight=weight)
        self.total_bytes = total
        self.segments: list[list[bytes | memoryview | None]] = [
            [None] * layout.num_layers for _ in self.tokens
        ]
        self.arrays: list[np.ndarray | None] = [None] * len(self.tokens)
        self.checks = [
            ArrivalCheck(layout.num_layers, layout.segment_bytes(len(t))) for t in self.tokens
        ]
        self.received = 0

    def _slot(self, j: int, layer: int) -> memoryview:
        """Where layer `layer` of chunk `j` goes in the chunk's own buffer (uninitialised:
        every byte of it is written before the commit)."""
        size = self.layout.segment_bytes(len(self.tokens[j]))
        if self.arrays[j] is None:
            self.arrays[j] = np.empty(size * self.layout.num_layers, dtype=np.uint8)
        return memoryview(self.arrays[j])[layer * size : (layer + 1) * size]

    def _check_signatures(self, signatures: Sequence[bytes]) -> list[bytes]:
        if signatures and len(signatures) != len(self.indices):
            raise InvalidArgument(
                f"header.signatures: {len(signatures)} given, one per chunk ({len(self.indices)}) "
                "or none expected"
            )
        return list(signatures)

    def _check_indices(self, n_chunks: int) -> None:
        if not self.indices:
            raise InvalidArgument("header.chunk_indices: at least one chunk is required")
        if len(set(self.indices)) != len(self.indices):
            raise InvalidArgument("header.chunk_indices: indices must be unique")
        if min(self.indices) < 0 or max(self.indices) >= n_chunks:
            raise InvalidArgument(f"header.chunk_indices: must be in [0, {n_chunks})")

    def layer_pieces(self, layer: int) -> list[tuple[int, memoryview]]:
        """Where one layer of every chunk goes: (chunk, writable view) in data-plane wire
        order (K then V, per head, per chunk). Fill each in that order and then call
        `arrived` with it; the layer counts as received. Each chunk gets one uninitialised
        buffer for all its layers (no zero-fill pass: the socket writes every byte of it)."""
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidArgument(f"frame.layer: {layer} is not in [0, {self.layout.num_layers})")
        if any(self.segments[j][layer] is not None for j in range(len(self.indices))):
            raise InvalidArgument(f"frame: layer {layer} sent twice")
        self.reservation.grow(self.layer_bytes)
        buffers = []
        for j in range(len(self.tokens)):
            buffers.append(self._slot(j, layer))
            self.segments[j][layer] = buffers[-1]
        self.received += len(buffers)
        row_bytes = self.layout.head_dim * self.layout.itemsize
        lengths = [len(t) for t in self.tokens]
        return head_major_pieces(buffers, lengths, self.layout.num_kv_heads, row_bytes)

    def arrived(self, chunk: int, layer: int, piece: memoryview) -> None:
        """`piece` of `layer_pieces(layer)` is filled: check it while it is hot."""
        self.checks[chunk].arrived(layer, piece, self.segments[chunk][layer])

    @property
    def layer_bytes(self) -> int:
        return sum(self.layout.segment_bytes(len(t)) for t in self.tokens)

    def add(self, layer: int, chunk: int, data) -> None:
        """Stage one segment: `data` (a view of a received message) is copied into the
        chunk's own buffer, its bytes first held in the receive budget."""
        if not 0 <= chunk < len(self.indices):
            raise InvalidArgument(f"segment.chunk: {chunk} is not in [0, {len(self.indices)})")
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidArgument(f"segment.layer: {layer} is not in [0, {self.layout.num_layers})")
        size = self.layout.segment_bytes(len(self.tokens[chunk]))
        if len(data) != size:
            raise InvalidArgument(
                f"segment.data: layer {layer} of chunk {chunk} has {len(data)} bytes, "
                f"expected {size} (K and V of {len(self.tokens[chunk])} tokens)"
            )
        if self.segments[chunk][layer] is not None:
            raise InvalidArgument(f"segment: layer {layer} of chunk {chunk} sent twice")
        self.reservation.grow(size)
        slot = self._slot(chunk, layer)
        slot[:] = data
        self.segments[chunk][layer] = slot
        self.checks[chunk].arrived(layer, slot, slot)
        self.received += 1

    def commit(self, crcs: Sequence[int]) -> Committed:
        expected = len(self.indices) * self.layout.num_layers
        if self.received != expected:
            raise InvalidArgument(
                f"commit: {expected - self.received} of {expected} segments are missing"
            )
        if len(crcs) != len(self.indices):
            raise InvalidArgument(f"commit.crc32c: expected {len(self.indices)} values")
        blobs = [self._blob(j, crc) for j, crc in enumerate(crcs)]
        self.close()  # the commit checks quota and room itself, under the shard's lock
        return self.shard.commit(blobs, self.owner, self.quota)

    def close(self) -> None:
        """Release what the put reserved (idempotent): after its commit, or when it ends
        without one."""
        self.reservation.release()

    def _blob(self, j: int, crc: int) -> Blob:
        data, check = tuple(self.segments[j]), self.checks[j]
        if check.crc() != crc:
            raise InvalidArgument(f"commit.crc32c[{j}]: chunk {j} arrived corrupted")
        self.segments[j] = []
        digest = check.digest()
        signature = self.signatures[j] if self.signatures else b""
        signed = signature != b"" and self.shard.check_signature(
            chunk_statement(self.layout, self.token_digests[j], digest),
            signature,
            f"header.signatures[{j}]",
        )
        return Blob(
            id=chunk_id(self.namespace, self.keys[j]),
            layout=self.layout,
            owner=self.owner,
            tokens=tuple(self.tokens[j]),
            segment_bytes=self.layout.segment_bytes(len(self.tokens[j])),
            crcs=tuple(check.crcs),
            data=data,
            meta={
                "parent": self.parents[j],
                "digest": digest.hex(),
                "signature": signature.hex(),
                "signed": signed,
                "proof": PROOF_FORMAT,
            },
        )
