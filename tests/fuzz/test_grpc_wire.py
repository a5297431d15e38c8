"""The hand-rolled protobuf codec of bulk messages (`prefix_store.protocol.wire`): FetchResponse and
PutRequest segment batches. Clear error: InvalidArgument (INVALID_ARGUMENT on a shard; the
client's fetch fails over). Whatever it accepts, the generated protobuf parser accepts too
and reads the same values (it may refuse more: groups, which no VeriCache peer sends)."""

from __future__ import annotations

from google.protobuf.message import DecodeError
from hypothesis import example, given
from hypothesis import strategies as st
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.errors import InvalidArgument
from prefix_store.protocol import wire
from tests.fuzz.mutate import memory_cap, mutated

MASK = 2**32 - 1
U32 = st.integers(0, 2**32 - 1)
SEGMENTS = st.lists(st.tuples(U32, U32, st.binary(max_size=64), st.none() | U32), max_size=6)


def encoded(segments) -> list[tuple]:
    return [(layer, chunk, [data], crc) for layer, chunk, data, crc in segments]


def as_tuples(decoded) -> list[tuple]:
    return [(layer, chunk, bytes(data), crc) for layer, chunk, data, crc in decoded]


FETCH = SEGMENTS.map(lambda s: wire.fetch_response(encoded(s)))
PUT = SEGMENTS.map(lambda s: wire.put_segments([(a, b, [d]) for a, b, d, _ in s]))


@given(SEGMENTS)
def test_fetch_response_round_trips(segments):
    raw = wire.fetch_response(encoded(segments))
    assert as_tuples(wire.decode_segments(memoryview(raw))) == segments
    parsed = pb.FetchResponse.FromString(raw)
    assert [(s.layer, s.chunk, s.data, s.crc32c) for s in parsed.segments] == [
        (a, b, d, c or 0) for a, b, d, c in segments
    ]


@given(SEGMENTS)
def test_put_segments_round_trip(segments):
    raw = wire.put_segments([(a, b, [d]) for a, b, d, _ in segments])
    part, value = wire.decode_put(raw)
    assert part == "segments"
    assert as_tuples(value) == [(a, b, d, None) for a, b, d, _ in segments]


def decode_or_refuse(raw: bytes):
    """The segments, or None when refused with InvalidArgument; nothing else escapes and
    nothing is allocated from a declared length."""
    try:
        with memory_cap():
            return as_tuples(wire.decode_segments(memoryview(raw)))
    except InvalidArgument:
        return None


def protobuf(raw: bytes):
    try:
        return pb.FetchResponse.FromString(raw)
    except DecodeError:
        return None


@given(mutated(FETCH))
@example(b"\x0a\x02\x25\x01")  # a CRC (fixed32) cut short: was read as 1
@example(b"\x0a\x01\x25")  # a CRC with none of its bytes
@example(b"\x09\x01\x02")  # a fixed64 unknown field cut short
@example(b"\x00\x01")  # field number 0: was skipped as an unknown field
@example(b"\x0a\x02\x00\x01")  # the same inside a segment
@example(b"\x0a\x05\xff\xff\xff\xff\x0f")  # a length past the end
@example(b"\x0a\x0a\x08\xff\xff\xff\xff\xff\xff\xff\xff\x7f")  # a varint of 70 bits
@example(b"\x80" * 8 + b"\x10\x00")  # a tag of 2^60 (unknown field 2^57): was skipped
@example(b"\x80\x80\x80\x80\x10\x00")  # a tag of 2^32: past protobuf's 32-bit tags
@example(b"\xf8\xff\xff\xff\x0f\x00")  # field 2^29 - 1, the largest: an unknown field
def test_fetch_response_mutations(raw):
    ours, theirs = decode_or_refuse(raw), protobuf(raw)
    if ours is None:
        return
    assert theirs is not None, "accepted a message protobuf refuses"
    # uint32 fields: protobuf keeps a varint's low 32 bits; wire keeps it whole, and every
    # caller refuses a layer or chunk index out of range.
    assert [(a & MASK, b & MASK, d, c or 0) for a, b, d, c in ours] == [
        (s.layer, s.chunk, s.data, s.crc32c) for s in theirs.segments
    ]


@given(mutated(PUT))
def test_put_request_mutations(raw):
    try:
        with memory_cap():
            part, value = wire.decode_put(raw)
    except InvalidArgument:
        return
    assert part in ("header", "segments", "commit", "")
    if part == "segments":
        for layer, chunk, data, _ in value:
            assert 0 <= layer < 2**64 and 0 <= chunk < 2**64
            assert len(data) <= len(raw)
