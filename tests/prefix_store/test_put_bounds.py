"""What a put may hold, and for how long, on a real shard over loopback: received messages
are copied out of (padding pins nothing), only bytes that arrived are reserved, every put
stream keeps a minimum rate (empty messages do not keep it alive), layouts and requests
are bounded per dimension and per method; and the shard's bookkeeping (LRU order under
the heartbeat's accounting, partial-chunk index, delete claims)."""

from __future__ import annotations

import gc
import socket
import threading
import time
import tracemalloc

import grpc
import pytest
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.config import ShardConfig
from prefix_store.layout import KVLayout
from prefix_store.pace import PutBounds
from prefix_store.protocol import wire
from prefix_store.protocol.frames import HEADER, OK, read_error, read_frame_header, redemption
from prefix_store.server import server_options
from prefix_store.shard import Deletable
from tests.prefix_store.conftest import LAYOUT
from tests.prefix_store.test_shard import CHUNK, SPACE, fetch_all, make, put

TOKENS = list(range(3000, 3016))  # one full chunk of LAYOUT
SEGMENT = LAYOUT.segment_bytes(16)
BIG = KVLayout("big-model@1", "float32", num_layers=64, num_kv_heads=32, head_dim=128)
"""2 MiB per token: 2,048 tokens declare 4 GiB, the most one put may (max_put_bytes)."""


def auth(token):
    return (("authorization", f"Bearer {token}"),)


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def header(layout, tokens, first_chunk_only=True):
    chunks = [0] if first_chunk_only else list(range(-(-len(tokens) // layout.chunk_tokens)))
    return pb.PutRequest(
        header=pb.PutHeader(layout=layout.to_proto(pb), token_ids=tokens, chunk_indices=chunks)
    ).SerializeToString()


def raw_put(channel):
    return channel.stream_unary(
        "/vericache.v1.PrefixStore/Put",
        request_serializer=None,
        response_deserializer=pb.PutResponse.FromString,
    )


def padded_segment(padding: int) -> bytes:
    """A PutRequest with one segment (layer 0, chunk 0) of SEGMENT bytes, whose Segment
    message also carries `padding` bytes in an unknown field (number 9)."""
    segment = (
        bytes([wire.SEGMENT_LAYER, 0, wire.SEGMENT_CHUNK, 0, wire.SEGMENT_DATA])
        + wire.varint(SEGMENT)
        + b"\x07" * SEGMENT
        + bytes([9 << 3 | 2])
        + wire.varint(padding)
        + bytes(padding)
    )
    batch = bytes([wire.REPEATED_SEGMENT]) + wire.varint(len(segment)) + segment
    return bytes([wire.PUT_SEGMENTS]) + wire.varint(len(batch)) + batch


def test_a_tiny_segment_padded_with_unknown_fields_pins_only_its_own_bytes(store, metadata):
    """Finding 2: each stream sends one 2 KiB segment inside a 16 MiB message and stays
    open. Only the segment's bytes are held (reserved, and allocated as traced by
    tracemalloc: the shard runs in this process), not the message."""
    server = store.start()
    token = metadata.add_tenant("padder")
    streams, padding = 8, 16 << 20
    release = threading.Event()

    def messages(first):
        yield header(LAYOUT, list(range(first, first + 16)))
        yield padded_segment(padding)
        yield b"\x12\x00"  # so that gRPC's sender lets go of the padded message
        release.wait(30)

    channel = grpc.insecure_channel(store.endpoints[0])
    put = raw_put(channel)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    futures = [put.future(messages(10_000 * (i + 1)), metadata=auth(token)) for i in range(streams)]
    try:
        wait_for(lambda: server.shard.received("padder") == streams * SEGMENT)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        assert held < padding, f"{held >> 20} MiB held by {streams} open puts"
    finally:
        tracemalloc.stop()
        release.set()
        for future in futures:
            with pytest.raises(grpc.RpcError):  # no commit: ABORTED, nothing stored
                future.result(timeout=10)
        channel.close()
    wait_for(lambda: server.shard.received() == 0)


def test_puts_kept_alive_by_empty_batches_hold_nothing_and_are_cut(store, metadata):
    """Finding 3: one tenant's two puts declare 4 GiB each and send only empty segment
    batches. They hold none of the receive budget (another tenant's put goes through
    meanwhile), and the rate rule cuts them with DEADLINE_EXCEEDED naming it."""
    bounds = PutBounds(grace_s=1.0, min_rate=64 * 1024, deadline_s=5.0)
    server = store.start(puts=bounds)
    hog = metadata.add_tenant("hog", 16 << 30)
    victim = metadata.add_tenant("victim")
    stop = threading.Event()

    def keep_alive(first):
        yield header(BIG, list(range(first, first + 2048)), first_chunk_only=False)
        while not stop.wait(0.05):
            yield b"\x12\x00"  # an empty SegmentBatch

    channel = grpc.insecure_channel(store.endpoints[0])
    put = raw_put(channel)
    futures = [put.future(keep_alive(f), metadata=auth(hog), timeout=30) for f in (1, 5000)]
    try:
        wait_for(lambda: server.shard.receiving.held_new.get("hog", 0) == 2 * BIG.chunk_bytes(2048))
        assert server.shard.received() == 0
        with store.client(victim) as client:
            from tests.prefix_store.conftest import random_kv

            client.publish_prefix(TOKENS, random_kv(LAYOUT, 16), LAYOUT)
            assert client.lookup(TOKENS, LAYOUT).tokens == 16
        for future in futures:
            with pytest.raises(grpc.RpcError) as cut:
                future.result(timeout=10)
            assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "minimum rate of 65536 bytes/s" in cut.value.details()
    finally:
        stop.set()
        channel.close()
    wait_for(lambda: server.shard.receiving.held_new.get("hog", 0) == 0)


def test_a_data_plane_put_trickling_bytes_is_cut_and_returns_its_reservation(store, metadata):
    bounds = PutBounds(grace_s=0.5, min_rate=64 * 1024, deadline_s=5.0)
    server = store.start(puts=bounds)
    token = metadata.add_tenant("trickler")
    channel = grpc.insecure_channel(store.endpoints[0])
    stub_open = channel.unary_unary(
        "/vericache.v1.PrefixStore/OpenPut",
        request_serializer=None,
        response_deserializer=pb.TransferTicket.FromString,
    )
    head = pb.PutRequest.FromString(header(LAYOUT, TOKENS)).header.SerializeToString()
    ticket = stub_open(head, metadata=auth(token), timeout=10)
    channel.close()
    host, port = ticket.data_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(redemption(ticket.ticket, token))
        sock.sendall(HEADER.pack(OK, 0, 1, SEGMENT))
        sent = 0
        try:
            while sent < SEGMENT:
                sock.sendall(b"\x01")  # one byte every 50 ms: far below 64 KiB/s
                sent += 1
                time.sleep(0.05)
        except OSError:
            pass  # cut
        magic, _, _, size = read_frame_header(sock)
        code, message, _ = read_error(sock, size)
    assert (magic, code) == (b"VCER", "DEADLINE_EXCEEDED")
    assert "below the minimum rate" in message
    wait_for(lambda: server.shard.received() == 0)
    assert server.shard.receiving.held_new.get("trickler", 0) == 0


@pytest.mark.parametrize(
    "change, field, limit",
    [
        (dict(num_layers=600), "header.layout.num_layers", "512]"),
        (dict(num_kv_heads=300), "header.layout.num_kv_heads", "256]"),
        (dict(chunk_tokens=1), "header.layout.chunk_tokens", "[16, 4096]"),
        (dict(chunk_tokens=8192), "header.layout.chunk_tokens", "[16, 4096]"),
        (
            dict(num_layers=512, num_kv_heads=256, head_dim=1024),
            "header.layout.bytes per token",
            str(64 << 20),
        ),
    ],
)
def test_layouts_out_of_the_shards_bounds_are_invalid_argument(
    store, metadata, change, field, limit
):
    store.start()
    token = metadata.add_tenant("shaper")
    fields = dict(num_layers=4, num_kv_heads=2, head_dim=8, chunk_tokens=16) | change
    layout = KVLayout("wild@1", "float32", **fields)
    channel = grpc.insecure_channel(store.endpoints[0])
    with pytest.raises(grpc.RpcError) as error:
        raw_put(channel)(iter([header(layout, TOKENS)]), metadata=auth(token), timeout=10)
    channel.close()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details() and limit in error.value.details()


def test_lookups_are_bounded_in_tokens_chunk_size_and_request_bytes(store, metadata):
    store.start(max_tokens=1000, max_request_bytes=64 * 1024)
    token = metadata.add_tenant("looker")
    channel = grpc.insecure_channel(store.endpoints[0])
    lookup = channel.unary_unary(
        "/vericache.v1.PrefixStore/Lookup",
        request_serializer=pb.LookupRequest.SerializeToString,
        response_deserializer=pb.LookupResponse.FromString,
    )
    describe = channel.unary_unary(
        "/vericache.v1.PrefixStore/Describe",
        request_serializer=None,
        response_deserializer=pb.DescribeResponse.FromString,
    )
    tiny = KVLayout("m@1", "float32", 4, 2, 8, chunk_tokens=16).to_proto(pb)
    tiny.chunk_tokens = 1
    cases = [
        (pb.LookupRequest(layout=LAYOUT.to_proto(pb), token_ids=[1] * 1001), "limit of 1000"),
        (pb.LookupRequest(layout=tiny, token_ids=[1] * 100), "layout.chunk_tokens: 1"),
        (pb.LookupRequest(layout=LAYOUT.to_proto(pb), token_ids=[1 << 20] * 30_000), "65536"),
        (
            pb.LookupRequest(layout=LAYOUT.to_proto(pb), token_ids=[1] * 32, chunk_indices=[0] * 3),
            "chunk_indices",
        ),
    ]
    for request, message in cases:
        with pytest.raises(grpc.RpcError) as error:
            lookup(request, metadata=auth(token), timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert message in error.value.details()
    with pytest.raises(grpc.RpcError) as error:  # Describe takes a few bytes, not megabytes
        describe(b"\x52" + wire.varint(100_000) + bytes(100_000), metadata=auth(token), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "DescribeRequest" in error.value.details() and "65536" in error.value.details()
    assert lookup(pb.LookupRequest(layout=LAYOUT.to_proto(pb), token_ids=TOKENS),
                  metadata=auth(token), timeout=10).cached_tokens == 0  # fmt: skip
    channel.close()


def test_the_transport_receives_no_more_than_the_streams_need():
    config = ShardConfig(max_message_bytes=64 << 20)
    options = dict(server_options(config))
    assert options["grpc.max_receive_message_length"] == (64 << 20) + (1 << 20)


# ---- the shard's bookkeeping --------------------------------------------------------------


def test_accounting_and_counts_leave_the_lru_order_as_reads_made_it(tmp_path):
    shard = make(tmp_path, memory_chunks=8)
    blobs = {name: list(range(i * 100, i * 100 + 16)) for i, name in enumerate("ABCDEFGH")}
    keys = {name: put(shard, tokens)[0][0] for name, tokens in blobs.items()}
    for name in "ACEG":  # reads: these become the most recently used
        fetch_all(shard, keys[name], (16,))
    for _ in range(3):  # what the heartbeat and Stats do, every second
        assert shard.accounting() == (8 * CHUNK, 8 * CHUNK)
        shard.counts(owner="a")
    for first in range(5000, 5400, 100):  # four evictions: the four least recently read
        put(shard, list(range(first, first + 16)))
    present = {n for n, t in blobs.items() if shard.lookup(SPACE, LAYOUT, t).cached_tokens}
    assert present == set("ACEG")


def test_removing_partial_chunks_leaves_no_index_behind(tmp_path):
    shard = make(tmp_path)
    for first in range(0, 2000, 100):
        tokens = list(range(first, first + 8))  # one partial chunk each
        put(shard, tokens)
        shard.delete(SPACE, LAYOUT, tokens)
    assert shard.usage() == {}
    assert len(shard.holdings.partials) == 0


def test_a_writers_delete_removes_only_its_own_claim(tmp_path):
    shard = make(tmp_path)

    def put_as(owner):
        session = shard.begin_put(SPACE, LAYOUT, TOKENS, [0], owner, lambda o: None)
        data = bytes(SEGMENT)
        for layer in range(LAYOUT.num_layers):
            session.add(layer, 0, data)
        from prefix_store.blob import combined_crc

        return session.commit([combined_crc([data] * LAYOUT.num_layers)]).keys

    keys = put_as("a")
    put_as("b")  # b's publish found it present: b relies on it too
    assert shard.delete_keys(SPACE, keys, Deletable("w"))[0] == 0  # w never put it
    assert shard.delete_keys(SPACE, keys, Deletable("a"))[0] == 0  # b still claims it
    assert shard.lookup(SPACE, LAYOUT, TOKENS).cached_tokens == 16
    assert shard.delete_keys(SPACE, keys, Deletable("b", everything=True))[0] == 1
