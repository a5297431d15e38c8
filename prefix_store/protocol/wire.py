"""Hand-rolled protobuf encoding of the bulk messages (`FetchResponse`, the segments of a
`PutRequest`), byte-compatible with the generated classes in vericache.v1.

Why: a layer of KV is megabytes. The generated classes copy each `bytes` field on parse
and on serialise; here a message is built with one join of the stored segment buffers and
parsed into memoryviews of the received buffer, so the payload is copied once per side.
Any protobuf client can still talk to the store: these are ordinary protobuf messages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prefix_store.errors import InvalidArgument

# (field number << 3) | wire type; wire type 0 = varint, 2 = length-delimited, 5 = 32-bit.
SEGMENT_LAYER = 0x08
SEGMENT_CHUNK = 0x10
SEGMENT_DATA = 0x1A
SEGMENT_CRC = 0x25
REPEATED_SEGMENT = 0x0A  # FetchResponse.segments and SegmentBatch.segments (field 1)
PUT_HEADER = 0x0A
PUT_SEGMENTS = 0x12
PUT_COMMIT = 0x1A
MAX_FIELD_NUMBER = (1 << 29) - 1


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise InvalidArgument("message: truncated or malformed varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode_segments(segments: Sequence[tuple]) -> list:
    """Parts whose concatenation is the repeated `segments` field: for each
    (layer, chunk, buffers[, crc32c]) one Segment whose data is the buffers back to back,
    carrying the CRC-32C when one is given (fetched segments: the stored checksum)."""
    parts: list = []
    for layer, chunk, buffers, *crc in segments:
        size = sum(memoryview(b).nbytes for b in buffers)
        head = bytes([SEGMENT_LAYER]) + varint(layer) + bytes([SEGMENT_CHUNK]) + varint(chunk)
        if crc and crc[0] is not None:
            head += bytes([SEGMENT_CRC]) + crc[0].to_bytes(4, "little")
        head += bytes([SEGMENT_DATA]) + varint(size)
        parts.append(bytes([REPEATED_SEGMENT]) + varint(len(head) + size) + head)
        parts.extend(buffers)
    return parts


def fetch_response(segments: Sequence[tuple]) -> bytes:
    """A serialised FetchResponse."""
    return b"".join(encode_segments(segments))


def put_segments(segments: Sequence[tuple[int, int, Sequence]]) -> bytes:
    """A serialised PutRequest carrying a SegmentBatch."""
    parts = encode_segments(segments)
    size = sum(memoryview(p).nbytes for p in parts)
    return b"".join([bytes([PUT_SEGMENTS]), varint(size), *parts])


def fields(
    buf: memoryview, start: int = 0, end: int | None = None
) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of a message; value is an int or a memoryview."""
    pos, end = start, len(buf) if end is None else end
    while pos < end:
        tag, pos = read_varint(buf, pos)
        number, kind = tag >> 3, tag & 7
        if number == 0:
            raise InvalidArgument("message: field number 0 (protobuf has none)")
        if number > MAX_FIELD_NUMBER:  # protobuf's tags are 32 bits: it refuses these too
            raise InvalidArgument(f"message: field number past protobuf's {MAX_FIELD_NUMBER}")
        if kind == 0:
            value, pos = read_varint(buf, pos)
        elif kind == 2:
            size, pos = read_varint(buf, pos)
            if pos + size > end:
                raise InvalidArgument("message: a field runs past the end of the message")
            value, pos = buf[pos : pos + size], pos + size
        elif kind in (1, 5) and pos + (8 if kind == 1 else 4) > end:
            raise InvalidArgument("message: a fixed-size field runs past the end of the message")
        elif kind == 5:
            value, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        elif kind == 1:
            value, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        else:
            raise InvalidArgument(f"message: unsupported wire type {kind}")
        yield number, kind, value


def decode_segments(buf: memoryview) -> list[tuple[int, int, memoryview, int | None]]:
    """The (layer, chunk, data, crc32c or None) of a FetchResponse or SegmentBatch, data as
    views of buf."""
    out = []
    for number, kind, value in fields(buf):
        if number != 1 or kind != 2:
            continue
        layer = chunk = 0
        data = memoryview(b"")
        crc = None
        for n, k, v in fields(value):
            if n == 1 and k == 0:
                layer = v
            elif n == 2 and k == 0:
                chunk = v
            elif n == 3 and k == 2:
                data = v
            elif n == 4 and k == 5:
                crc = v
        out.append((layer, chunk, data, crc))
    return out


def decode_put(raw: bytes) -> tuple[str, object]:
    """A PutRequest as ("header" | "commit", raw field bytes) or ("segments", list)."""
    buf = memoryview(raw)
    for number, kind, value in fields(buf):
        if kind != 2:
            break
        if number == 1:
            return "header", bytes(value)
        if number == 2:
            return "segments", decode_segments(value)
        if number == 3:
            return "commit", bytes(value)
    return "", None
