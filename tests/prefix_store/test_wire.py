"""The hand-rolled bulk encoding is ordinary protobuf: the generated classes agree."""

from __future__ import annotations

import os

import pytest
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.blob import crc32c
from prefix_store.errors import InvalidArgument
from prefix_store.protocol import wire

SEGMENTS = [
    (0, 0, (os.urandom(300),)),
    (0, 1, (b"ab", b"cd")),
    (5, 2, (b"",)),
    (200, 70000, (b"x" * 130,)),
]
FETCHED = [(*segment, crc32c(b"".join(segment[2]))) for segment in SEGMENTS]


def test_fetch_response_parses_with_the_generated_class_crc_included():
    message = pb.FetchResponse.FromString(wire.fetch_response(FETCHED))
    assert [(s.layer, s.chunk, s.data, s.crc32c) for s in message.segments] == [
        (layer, chunk, b"".join(parts), crc) for layer, chunk, parts, crc in FETCHED
    ]
    decoded = wire.decode_segments(memoryview(wire.fetch_response(FETCHED)))  # 0 included
    assert [(a, b, bytes(c), d) for a, b, c, d in decoded] == [
        (layer, chunk, b"".join(parts), crc) for layer, chunk, parts, crc in FETCHED
    ]


def test_put_segments_parse_with_the_generated_class_and_back():
    raw = wire.put_segments(SEGMENTS)
    message = pb.PutRequest.FromString(raw)
    assert message.WhichOneof("part") == "segments"
    assert len(message.segments.segments) == len(SEGMENTS)
    part, decoded = wire.decode_put(message.SerializeToString())
    assert part == "segments"
    assert [(a, b, bytes(c), d) for a, b, c, d in decoded] == [
        (s.layer, s.chunk, s.data, None) for s in message.segments.segments
    ]


def test_decoding_generated_messages():
    generated = pb.FetchResponse(segments=[pb.Segment(layer=3, chunk=1, data=b"kv")])
    assert [
        (a, b, bytes(c), d)
        for a, b, c, d in wire.decode_segments(memoryview(generated.SerializeToString()))
    ] == [(3, 1, b"kv", None)]
    header = pb.PutRequest(header=pb.PutHeader(namespace="n", token_ids=[1, 2]))
    part, raw = wire.decode_put(header.SerializeToString())
    assert part == "header" and pb.PutHeader.FromString(raw).token_ids == [1, 2]


@pytest.mark.parametrize("raw", [b"\x0a\xff", b"\x0a\x05ab", b"\x0f"])
def test_malformed_messages_are_invalid_arguments(raw):
    with pytest.raises(InvalidArgument):
        wire.decode_segments(memoryview(raw))
