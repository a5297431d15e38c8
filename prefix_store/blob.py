"""What the tiers store: chunks of prefix KV and compressed artifacts, with checksums."""

from __future__ import annotations

from dataclasses import dataclass, field

import crc32c as _crc32c

from prefix_store.layout import KVLayout

# A blob's identity inside a shard: ("chunk", namespace, key) or
# ("artifact", namespace, prefix_key, compressor, layout identity).
BlobId = tuple


def crc32c(data, value: int = 0) -> int:
    """CRC-32C (hardware accelerated) of any buffer, continuing from `value`."""
    return _crc32c.crc32c(data, value=value)


@dataclass(slots=True)
class Blob:
    """Bytes plus what they mean. `data` is split into equal segments (a chunk's layers;
    an artifact is one segment), each with its own CRC-32C checked on every read."""

    id: BlobId
    layout: KVLayout
    owner: str
    """The tenant whose quota pays for the bytes."""
    tokens: tuple[int, ...]
    """A chunk's tokens (confirms hits); an artifact's prefix length as a 1-tuple."""
    segment_bytes: int
    crcs: tuple[int, ...]
    data: tuple[bytes | memoryview, ...] | None = None
    """The segments, immutable (bytes, or read-only views of received messages, which they
    keep alive); None while the blob lives only on disk."""
    meta: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.id[0]

    @property
    def namespace(self) -> str:
        return self.id[1]

    @property
    def nbytes(self) -> int:
        return self.segment_bytes * len(self.crcs)

    def segment(self, index: int) -> bytes | memoryview:
        assert self.data is not None
        return self.data[index]

    def without_data(self) -> Blob:
        return Blob(
            self.id,
            self.layout,
            self.owner,
            self.tokens,
            self.segment_bytes,
            self.crcs,
            None,
            self.meta,
        )


def combined_crc(segments) -> int:
    """CRC-32C of the segments back to back."""
    crc = 0
    for segment in segments:
        crc = crc32c(segment, crc)
    return crc
