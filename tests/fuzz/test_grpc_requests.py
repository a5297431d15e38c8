"""gRPC requests as a shard parses them (`prefix_store.server.parse`, `request`, the Put
stream through `wire.decode_put`). Structure-aware: a valid request of each method, then
wild values in its fields (extreme integers, long strings, large repeated fields, unknown
fields), then byte damage. Clear error: `parse` raises InvalidArgument; over a real shard
on loopback every call ends with a precise status, never UNKNOWN or INTERNAL nor a hang,
and the shard keeps serving."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import event, example, given
from hypothesis import strategies as st
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.errors import InvalidArgument
from prefix_store.layout import KVLayout
from prefix_store.protocol import wire
from prefix_store.server import REQUESTS, STREAMS
from rpc.server import parse
from tests.fuzz.mutate import memory_cap, mutated, share
from tests.hostile import BROKEN, Method, call

LAYOUT = KVLayout("fuzz@1", "float32", num_layers=2, num_kv_heads=1, head_dim=2, chunk_tokens=16)
TOKENS = list(range(100, 132))


def layout() -> pb.KVLayout:
    return LAYOUT.to_proto(pb)


def chunk() -> pb.ChunkRef:
    return pb.ChunkRef(key=12345, tokens=16)


def artifact() -> pb.ArtifactId:
    return pb.ArtifactId(layout=layout(), prefix_key=1, prefix_tokens=32, compressor="x", size=8)


VALID = {
    "Describe": [pb.DescribeRequest()],
    "Stats": [pb.StatsRequest()],
    "Lookup": [pb.LookupRequest(layout=layout(), token_ids=TOKENS)],
    "Delete": [pb.DeleteRequest(layout=layout(), token_ids=TOKENS)],
    "OpenFetch": [pb.FetchRequest(layout=layout(), chunks=[chunk()])],
    "Fetch": [pb.FetchRequest(layout=layout(), chunks=[chunk()])],
    "OpenPut": [pb.PutHeader(layout=layout(), token_ids=TOKENS, chunk_indices=[0, 1])],
    "FetchArtifact": [pb.FetchArtifactRequest(id=artifact())],
    "OpenFetchArtifact": [pb.FetchArtifactRequest(id=artifact())],
    "OpenPutArtifact": [artifact()],
    "PutArtifact": [
        pb.PutArtifactRequest(id=artifact()),
        pb.PutArtifactRequest(data=bytes(8)),
        pb.PutArtifactRequest(crc32c=0),
    ],
    "Put": [
        pb.PutRequest(
            header=pb.PutHeader(layout=layout(), token_ids=TOKENS[:16], chunk_indices=[0])
        ),
        pb.PutRequest(
            segments=pb.SegmentBatch(
                segments=[pb.Segment(layer=i, chunk=0, data=bytes(256)) for i in range(2)]
            )
        ),
        pb.PutRequest(commit=pb.PutCommit(crc32c=[0])),
    ],
    "Attend": [
        pb.AttendRequest(header=pb.AttendHeader(layout=layout(), chunks=[chunk()])),
        pb.AttendRequest(query=pb.AttendQuery(layer=0, rows=1, q=bytes(8))),
    ],
}
assert set(VALID) == set(REQUESTS) | set(STREAMS)

UINT32 = st.sampled_from([0, 1, 16, 2**31 - 1, 2**32 - 1]) | st.integers(0, 2**32 - 1)
UINT64 = st.sampled_from([0, 1, 2**63 - 1, 2**64 - 1]) | st.integers(0, 2**64 - 1)
INT = {
    FieldDescriptor.TYPE_UINT32: UINT32,
    FieldDescriptor.TYPE_FIXED32: UINT32,
    FieldDescriptor.TYPE_UINT64: UINT64,
    FieldDescriptor.TYPE_FIXED64: UINT64,
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
}


def scalar(field: FieldDescriptor) -> st.SearchStrategy:
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=8) | st.sampled_from(["x" * 300, "../..", "\u202e", "a:b=1"])
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64) | st.sampled_from([bytes(4096), bytes(1 << 17)])
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(width=32 if field.type == FieldDescriptor.TYPE_FLOAT else 64)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    return INT[field.type]


def paths(message, depth: int = 0) -> list[tuple]:
    """(holder, field) of every field reachable within 3 levels (set submessages or not)."""
    out = []
    for field in message.DESCRIPTOR.fields:
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            out.append((message, field))
        elif depth < 3 and not field.is_repeated:
            out += paths(getattr(message, field.name), depth + 1)
        elif depth < 3 and len(getattr(message, field.name)):
            out += paths(getattr(message, field.name)[0], depth + 1)
    return out


@st.composite
def wild(draw, base):
    """`base` with up to three fields set to extreme or nonsensical values."""
    message = type(base)()
    message.CopyFrom(base)
    found = paths(message)
    for _ in range(draw(st.integers(0, 3)) if found else 0):
        holder, field = draw(st.sampled_from(found))
        values = draw(st.lists(scalar(field), min_size=1, max_size=3))
        if field.is_repeated:
            container = getattr(holder, field.name)
            del container[:]
            sized = field.type in (FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_STRING)
            many = draw(st.sampled_from([1, 1, 1, 64 if sized else 70_000]))
            values = [v[:64] for v in values] if sized and many > 1 else values
            container.extend((values * many)[: max(len(values), many)])
        else:
            setattr(holder, field.name, values[0])
    return message.SerializeToString()


def requests(method: str) -> st.SearchStrategy[list[bytes]]:
    """The method's messages (one for a unary call), each wild, then damaged."""
    return st.tuples(*[mutated(wild(m), max_edits=2) for m in VALID[method]]).map(list)


@given(st.sampled_from(sorted(REQUESTS)), st.data())
@example("Lookup", None)
def test_parse(method, data):
    """Every request class the shard parses: a message, or InvalidArgument."""
    cls = REQUESTS[method]
    raw = data.draw(requests(method))[0] if data is not None else b"\x12\xff\xff\xff\xff\x0f"
    try:
        with memory_cap():
            parse(cls, raw)
    except InvalidArgument:
        pass


@given(requests("Put"))
def test_put_stream_messages(raws):
    """A Put's messages as the shard reads them (`wire.decode_put`)."""
    for raw in raws:
        try:
            with memory_cap():
                wire.decode_put(raw)
        except InvalidArgument:
            pass


@pytest.fixture(scope="module")
def channel(shard):
    import grpc

    store, token = shard
    with grpc.insecure_channel(store.endpoints[0]) as channel:
        yield channel, (("authorization", f"Bearer {token}"),)


def send(channel, method: str, raws: list[bytes], metadata):
    streaming = method in STREAMS
    replies = method in ("Fetch", "FetchArtifact", "Attend")
    target = Method(f"/vericache.v1.PrefixStore/{method}", None, streaming, replies)
    if streaming:
        return _send_stream(channel, target, raws, metadata)
    return call(channel, target, raws[0], metadata, timeout=30)


def _send_stream(channel, target: Method, raws: list[bytes], metadata):
    import grpc

    identity = dict(request_serializer=None, response_deserializer=None)
    try:
        if target.server_streaming:
            for _ in channel.stream_stream(target.path, **identity)(
                iter(raws), metadata=metadata, timeout=30
            ):
                pass
        else:
            channel.stream_unary(target.path, **identity)(iter(raws), metadata=metadata, timeout=30)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


@share(0.6)
@given(st.sampled_from(sorted(VALID)), st.data())
def test_a_shard_answers_every_request(channel, method, data):
    import grpc

    channel, metadata = channel
    code, details = send(channel, method, data.draw(requests(method)), metadata)
    event(f"{method}: {code.name}")
    assert code not in BROKEN | {grpc.StatusCode.DEADLINE_EXCEEDED}, (method, code, details)
    assert send(channel, "Describe", [b""], metadata)[0] == grpc.StatusCode.OK
