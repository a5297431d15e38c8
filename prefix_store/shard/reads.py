"""Reads of a shard's blobs: leased while they are read, every segment checked against
its stored CRC-32C; a blob that fails is dropped and the read fails with `DataLoss` (a
later lookup reports a miss). The scrubber re-checks blobs at rest the same way."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prefix_store.blob import Blob, BlobId, crc32c
from prefix_store.errors import DataLoss, InvalidArgument, NotFound, Unavailable
from prefix_store.layout import KVLayout
from prefix_store.namespace import Namespace
from prefix_store.shard.blobs import chunk_id, proof_of
from prefix_store.shard.holdings import Holdings

log = logging.getLogger("prefix_store.shard")


@dataclass(frozen=True, slots=True)
class ChunkRef:
    key: int
    tokens: int
    digest: bytes = b""
    """When set, only a chunk whose stored bytes have this digest may be served."""


class Reader:
    """Thread-safe (the holdings' lock, never held while bytes are copied or read)."""

    def __init__(self, holdings: Holdings) -> None:
        self.holdings = holdings

    def open_fetch(
        self,
        namespace: Namespace,
        layout: KVLayout,
        refs: Sequence[ChunkRef],
        layer_start: int,
        layer_end: int,
    ) -> FetchStream:
        """Check the request and lease its chunks now; the stream reads them later."""
        if not 0 <= layer_start < layer_end <= layout.num_layers:
            raise InvalidArgument(
                f"layer range: [{layer_start}, {layer_end}) is not within [0, {layout.num_layers}]"
            )
        blobs = self._lease_chunks(namespace, layout, refs)
        return FetchStream(self, blobs, layer_start, layer_end)

    def _lease_chunks(self, namespace, layout, refs) -> list[Blob]:
        with self.holdings.lock:
            blobs = []
            for index, ref in enumerate(refs):
                blob = self.holdings.read_live(chunk_id(namespace, ref.key))
                if blob is None or blob.layout != layout or len(blob.tokens) != ref.tokens:
                    raise NotFound(f"chunks[{index}]: chunk {ref.key:016x} is not stored here")
                if ref.digest and proof_of(blob).digest != ref.digest:
                    raise NotFound(
                        f"chunks[{index}]: chunk {ref.key:016x} is stored here with other bytes "
                        "than the digest asked for"
                    )
                blobs.append(blob)
            self.holdings.leases.take(blob.id for blob in blobs)
            return blobs

    def current(self, blob_id: BlobId) -> Blob | None:
        """The blob now stored under `blob_id`, now the most recently used, not leased (a
        put may replace it, eviction move it: read it with `stored`, which tells); None:
        not held."""
        with self.holdings.lock:
            return self.holdings.read_live(blob_id)

    def lease(self, blob_id: BlobId) -> Blob | None:
        """The blob, leased (`release` it), now the most recently used; None: not held."""
        with self.holdings.lock:
            blob = self.holdings.read_live(blob_id)
            if blob is not None:
                self.holdings.leases.take([blob_id])
            return blob

    def release(self, blob_ids: list[BlobId]) -> None:
        self.holdings.release(blob_ids)

    def segment(self, blob: Blob, index: int) -> bytes:
        """One segment of a leased blob, from whichever tier holds it, checked against its
        stored CRC-32C (`DataLoss` when it fails: the blob is dropped)."""
        data = self.stored(blob, index)
        self.check(blob, index, crc32c(data))
        return data

    def stored(self, blob: Blob, index: int) -> bytes:
        """One segment of a blob (leased, or `current` when it was looked up), from
        whichever tier holds it, not checked yet: the caller `check`s the CRC-32C it
        computes over it before trusting it. `DataLoss` when it cannot be read (the blob is
        dropped); `Unavailable` when an unleased blob was replaced or evicted meanwhile (a
        new read finds what is stored now)."""
        if blob.data is not None:
            return blob.segment(index)
        try:
            return self.holdings.placement.disk.read_segment(blob.id, index)
        except (OSError, KeyError) as error:
            if not self._is_stored(blob):
                raise Unavailable(
                    f"{blob.kind} {blob.id[2]:016x} was replaced or evicted while it was read"
                ) from error
            self._corrupt(blob, f"segment {index} unreadable: {error}")

    def check(self, blob: Blob, index: int, crc: int) -> None:
        """`DataLoss`, the blob dropped, unless `crc` (of the segment as read) is the one
        stored with it."""
        if crc != blob.crcs[index]:
            self._corrupt(blob, f"segment {index}")

    def _is_stored(self, blob: Blob) -> bool:
        """Whether `blob` is still the one stored under its id (not replaced or removed)."""
        with self.holdings.lock:
            found = self.holdings.placement.find(blob.id)
        return found is not None and found.crcs == blob.crcs and found.owner == blob.owner

    def _corrupt(self, blob: Blob, where: str) -> None:
        """Drop `blob` (when it is still the one stored: an unleased read may have seen one
        replaced since) and fail the read with DataLoss."""
        log.error(
            "shard %s: blob %s failed its checksum at %s; dropped",
            self.holdings.shard_id,
            blob.id[:3],
            where,
        )
        with self.holdings.mutating():
            if self._is_stored(blob):
                self.holdings.stats.corrupt += 1
                self.holdings.condemn(blob.id)
        raise DataLoss(
            f"chunk {blob.id[2]:016x}: stored bytes failed their checksum ({where}); "
            "dropped, read it from a replica"
        )

    # ---- scrubbing ---------------------------------------------------------------------

    def scrub(self, blob_id: BlobId) -> int:
        """Re-check a blob at rest: every segment against its stored CRC-32C, from the tier
        that holds it, without a lease (readers, puts and eviction never wait for it) and
        its recency unchanged. A blob that fails and is still the one read (not replaced
        or removed meanwhile) is dropped as a corrupt read drops it (counted in
        `stats.corrupt` and `stats.scrub_corrupt`), never served again. Returns the bytes
        checked (0: the blob is gone)."""
        holdings = self.holdings
        with holdings.lock:
            blob = holdings.find_live(blob_id)
        if blob is None:
            return 0
        for index in range(len(blob.crcs)):
            fault = self._check_at_rest(blob, index)
            if fault is not None:
                with holdings.lock:
                    if holdings.placement.find(blob_id) is not blob:
                        return 0  # replaced or removed while it was read: not a fault
                    holdings.stats.scrub_corrupt += 1
                with contextlib.suppress(DataLoss):
                    self._corrupt(blob, fault)
                break
        with holdings.lock:
            holdings.stats.scrubbed_bytes += blob.nbytes
        return blob.nbytes

    def _check_at_rest(self, blob: Blob, index: int) -> str | None:
        """What is wrong with one stored segment (unreadable, checksum), or None."""
        try:
            if blob.data is not None:
                data = blob.segment(index)
            else:
                data = self.holdings.placement.disk.read_segment(blob.id, index)
        except (OSError, KeyError) as error:
            return f"segment {index} unreadable at rest: {error}"
        return None if crc32c(data) == blob.crcs[index] else f"segment {index} (at rest)"


def fetch(
    reader: Reader,
    namespace: Namespace,
    layout: KVLayout,
    refs: Sequence[ChunkRef],
    layer_start: int,
    layer_end: int,
    message_bytes: int,
) -> Iterator[list[tuple[int, int, bytes, int]]]:
    """Batches of (layer, chunk index, K+V bytes, their stored CRC-32C): every chunk of a
    layer before the next layer, batches of about `message_bytes`. The chunks are leased
    (`Reader.open_fetch`, when the first batch is asked for) until it ends."""
    stream = reader.open_fetch(namespace, layout, refs, layer_start, layer_end)
    try:
        batch, size = [], 0
        for segment in stream.segments():
            batch.append(segment)
            size += len(segment[2])
            if size >= message_bytes:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch
    finally:
        stream.close()


class FetchStream:
    """Leased chunks being read: every chunk of a layer, then the next layer. `close`
    releases the leases (idempotent); reading checks every segment's checksum."""

    def __init__(self, reader: Reader, blobs: list[Blob], layer_start: int, layer_end: int):
        self.reader, self.blobs = reader, blobs
        self.layer_start, self.layer_end = layer_start, layer_end
        self._closed = False
        self.total_bytes = sum(b.segment_bytes for b in blobs) * (layer_end - layer_start)

    def layers(self) -> Iterator[tuple[int, list[bytes | memoryview], list[int]]]:
        """(layer, each chunk's segment, each one's stored CRC-32C): a layer is read and
        checked whole before it is handed out; the CRCs go with the bytes to the client,
        which checks them again on arrival."""
        stats = self.reader.holdings.stats
        for layer in range(self.layer_start, self.layer_end):
            segments = self.layer(layer)
            stats.fetched_bytes += sum(len(s) for s in segments)
            yield layer, segments, [blob.crcs[layer] for blob in self.blobs]

    def layer(self, layer: int) -> list[bytes | memoryview]:
        """Every chunk's segment of `layer` (K then V), each checked against its stored
        CRC-32C (`DataLoss` when one fails), from whichever tier holds it."""
        return [self.reader.segment(blob, layer) for blob in self.blobs]

    def segments(self) -> Iterator[tuple[int, int, bytes | memoryview, int]]:
        for layer, segments, crcs in self.layers():
            for index, (data, crc) in enumerate(zip(segments, crcs, strict=True)):
                yield layer, index, data, crc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.reader.release([b.id for b in self.blobs])
