"""LMCache frames (`prefix_store.lmcache`): client headers, the stored object envelope,
naive KV objects, and the gateway's socket loop. Clear errors: ProtocolError for a header
(its connection is closed, others go on); None for an envelope that is not a whole object
of its key (a miss); InvalidArgument for a naive object that does not fit the layout (the
prefix stops there). A gateway answers a frame or closes the connection, and keeps
serving well-formed requests."""

from __future__ import annotations

import contextlib
import os
import socket
import struct

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from prefix_store.errors import InvalidArgument
from prefix_store.layout import KVLayout
from prefix_store.lmcache.errors import ProtocolError
from prefix_store.lmcache.mapping import check_naive, find_prefix, naive_to_kv
from prefix_store.lmcache.objects import Envelope
from prefix_store.lmcache.protocol import (
    MAX_KEY_LENGTH,
    ClientHeader,
    Command,
    ObjectMeta,
    ReturnCode,
    client_header,
    parse_client_header,
)
from tests.fuzz.mutate import memory_cap, mutated, share

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
I32 = st.integers(-(2**31), 2**31 - 1)
KEYS = st.text(
    st.characters(codec="utf-8", categories=("L", "N", "P", "S")), min_size=1, max_size=40
).filter(lambda k: len(k.encode()) <= MAX_KEY_LENGTH and k.strip() == k)
METAS = st.builds(ObjectMeta, I32, I32, st.tuples(I32, I32, I32, I32))
MAX_OBJECT = 1 << 20


@st.composite
def headers(draw) -> tuple:
    command = draw(st.sampled_from(Command))
    length = draw(st.integers(1, MAX_OBJECT)) if command is Command.PUT else 0
    return command, draw(KEYS), length, draw(METAS)


@given(headers())
def test_client_headers_round_trip(header):
    command, key, length, meta = header
    parsed = parse_client_header(client_header(command, key, length, meta), MAX_OBJECT)
    assert parsed == ClientHeader(command, length, meta, key)


@given(mutated(headers().map(lambda h: client_header(*h[:3], h[3])), max_edits=3))
@example(struct.pack("=9i", 1, 2**31 - 1, 1, 2, 0, 0, 0, 0, 0) + b"k".ljust(150))  # 2 GiB PUT
@example(struct.pack("=9i", 1, -5, 1, 2, 0, 0, 0, 0, 0) + b"k".ljust(150))
@example(struct.pack("=9i", 2, 0, 1, 2, 0, 0, 0, 0, 0) + b"\xff" * 150)
def test_client_header_mutations(frame):
    frame = frame[: ClientHeader.SIZE].ljust(ClientHeader.SIZE, b"\0")  # the socket reads SIZE
    try:
        with memory_cap():
            header = parse_client_header(frame, MAX_OBJECT)
    except ProtocolError:
        return
    assert header.command in Command and header.key and header.key.isprintable()
    assert 0 < header.length <= MAX_OBJECT if header.command is Command.PUT else True


@given(KEYS, METAS, st.binary(max_size=256))
def test_envelopes_round_trip(key, meta, payload):
    stored = bytes(Envelope.head(key, meta, len(payload)) + payload)
    assert Envelope.size(key) + len(payload) == len(stored)
    opened = Envelope.open(key, stored)
    assert opened is not None and opened[0] == meta and bytes(opened[1]) == payload


@given(st.data())
def test_envelope_mutations(data):
    key, meta = data.draw(KEYS), data.draw(METAS)
    payload = data.draw(st.binary(max_size=64))
    stored = data.draw(mutated(st.just(bytes(Envelope.head(key, meta, len(payload)) + payload))))
    with memory_cap():
        opened = Envelope.open(key, stored)
    if opened is not None:  # then it is a whole object of this key, as declared
        assert len(stored) == Envelope.size(key) + len(opened[1])


LAYOUT = KVLayout("tiny", "float32", num_layers=2, num_kv_heads=2, head_dim=4)
NAIVE = ObjectMeta(1, 4, (2, LAYOUT.num_layers, 3, LAYOUT.num_kv_heads * LAYOUT.head_dim))


@given(st.integers(1, 8))
def test_naive_objects_round_trip(tokens):
    kv = torch.randn(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    naive = kv.permute(1, 0, 3, 2, 4).reshape(2, LAYOUT.num_layers, tokens, -1).contiguous()
    meta = ObjectMeta(1, 4, tuple(naive.shape))
    payload = memoryview(naive.numpy().tobytes())
    assert torch.equal(naive_to_kv(payload, meta, LAYOUT), kv)


@given(METAS, st.binary(max_size=512))
@example(NAIVE, bytes(4))  # shape says 3 tokens, 4 bytes came: was a RuntimeError from torch
@example(NAIVE._replace(shape=(2, 2, 2**30, 8)), bytes(64))  # a huge declared token count
def test_naive_object_mutations(meta, payload):
    try:
        with memory_cap():
            kv = naive_to_kv(payload, meta, LAYOUT)
    except InvalidArgument:
        return
    assert kv.numel() * kv.element_size() == len(payload)
    assert check_naive(meta, LAYOUT) == kv.shape[3]


class Objects:
    """What `find_prefix` reads: LMCache objects by key (as `ObjectStore.get` returns them)."""

    def __init__(self, found: dict) -> None:
        self.found = found

    def get(self, key: str):
        return self.found.get(key)


def test_a_short_object_ends_the_prefix_found():
    """An object whose shape claims more tokens than its bytes hold is a miss there: the
    prefix found stops before it (was a RuntimeError out of the import)."""
    from prefix_store.lmcache.mapping import LMCacheKeying, lmcache_keys

    keying = LMCacheKeying("tiny", "float32", chunk_size=3)
    tokens = list(range(6))
    first, second = lmcache_keys(tokens, keying)
    whole = torch.arange(LAYOUT.chunk_bytes(3) // 4, dtype=torch.float32).numpy().tobytes()
    objects = Objects({first: (NAIVE, memoryview(whole)), second: (NAIVE, memoryview(whole[:4]))})
    covered, kv = find_prefix(objects, tokens, keying, LAYOUT)
    assert covered == 3 and kv.shape == (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, 3, 4)


@pytest.fixture(scope="module")
def gateway(shard):
    from prefix_store.lmcache import GatewayConfig, LMCacheGateway

    store, token = shard
    config = GatewayConfig(
        tuple(store.endpoints), token, max_object_bytes=1 << 16, io_timeout_s=5, idle_timeout_s=5
    )
    gateway = LMCacheGateway(config)
    gateway.start()
    yield gateway
    gateway.stop()


@st.composite
def conversations(draw) -> bytes:
    """A few well-formed frames (a PUT with its payload), back to back."""
    frames = []
    for _ in range(draw(st.integers(1, 3))):
        command = draw(st.sampled_from(Command))
        key = draw(st.sampled_from(["m@1@0@1@float32", "m@1@0@2@float32"]))
        payload = draw(st.binary(min_size=1, max_size=64)) if command is Command.PUT else b""
        frames.append(client_header(command, key, len(payload), NAIVE) + payload)
    return b"".join(frames)


REPLY = struct.Struct("=9i")


def talk(address: str, sent: bytes) -> tuple[bytes, bool]:
    """What the gateway answers to `sent` (our side then closed for writing), and whether
    it reset the connection (it closes on a frame it will not parse)."""
    host, port = address.rsplit(":", 1)
    received, reset = bytearray(), False
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(sent)
            sock.shutdown(socket.SHUT_WR)
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            reset = True
    return bytes(received), reset


def replies(received: bytes, reset: bool) -> list[int]:
    """The return codes of well-formed replies (a GET hit with its payload); a trailing
    partial reply only when the connection was reset."""
    codes, pos = [], 0
    while pos + REPLY.size <= len(received):
        code, length, *_ = REPLY.unpack_from(received, pos)
        assert code in (ReturnCode.SUCCESS, ReturnCode.FAIL) and 0 <= length <= 1 << 16
        pos += REPLY.size + length
        codes.append(code)
    assert pos == len(received) or reset
    return codes


def healthy(address: str) -> bool:
    received, _ = talk(address, client_header(Command.HEALTH, "h"))
    return replies(received, False) == [ReturnCode.SUCCESS]


@share(0.4)
@given(mutated(conversations(), max_edits=2))
@example(client_header(Command.PUT, "k", 1 << 16) + b"x" * 10)  # a PUT cut short
@example(client_header(Command.GET, "k")[:-150] + b"\xff" * 150)  # a key that is not UTF-8
def test_gateway_answers_or_closes(gateway, sent):
    received, reset = talk(gateway.address, sent)
    assert len(replies(received, reset)) <= len(sent) // ClientHeader.SIZE
    assert healthy(gateway.address)
