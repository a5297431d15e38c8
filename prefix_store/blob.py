"""What the tiers store: chunks of prefix KV and compressed artifacts, with checksums."""

from __future__ import annotations

import functools
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


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32C of A then B from each one's CRC-32C and B's length, without B's bytes.

    CRC-32C continued over B from a start value c is linear in c: crc32c(B, c) =
    crc32c(B, 0) ^ L(c), where L advances the register over `len_b` zero bytes and depends
    on the length alone. L is tabulated once per length (`_advance`), a byte at a time."""
    t0, t1, t2, t3 = _advance(len_b)
    return (
        t0[crc_a & 0xFF] ^ t1[(crc_a >> 8) & 0xFF] ^ t2[(crc_a >> 16) & 0xFF] ^ t3[crc_a >> 24]
    ) ^ crc_b


@functools.lru_cache(maxsize=64)
def _advance(length: int) -> tuple[tuple[int, ...], ...]:
    """L for `length` zero bytes as four 256-entry tables (one per byte of the start value),
    from L's image of each of the 32 bits: L(c) = crc32c(zeros, c) ^ crc32c(zeros, 0)."""
    zeros = bytes(length)
    base = crc32c(zeros)
    bits = [crc32c(zeros, 1 << i) ^ base for i in range(32)]
    tables = []
    for byte in range(4):
        table = [0] * 256
        for value in range(1, 256):
            low = value & -value  # the lowest set bit: table[value] = table[rest] ^ L(bit)
            table[value] = table[value ^ low] ^ bits[8 * byte + low.bit_length() - 1]
        tables.append(tuple(table))
    return tuple(tables)
