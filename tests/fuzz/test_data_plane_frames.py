"""Data-plane frames (`prefix_store.data_plane`, `prefix_store.client.transfer`, and the
shard's `receive_put`). A client reading a shard's frames: the clear error is a typed
StoreError (Unavailable, DataLoss, ...: the fetch fails over), and what it accepts is
exactly what was sent; no declared size is allocated. A shard reading a client's put
frames over a real connection: it answers an in-band error frame with a precise status
(never INTERNAL) or closes, and keeps serving well-formed puts."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

import grpc
import numpy as np
import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st
from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from prefix_store.blob import combined_crc, crc32c
from prefix_store.client.plan import Assembly, CachedPrefix, ChunkPlan
from prefix_store.client.transfer import receive, send_put
from prefix_store.errors import StoreError
from prefix_store.layout import KVLayout
from prefix_store.protocol.frames import (
    CHECKED,
    COMMIT,
    DONE,
    ERROR,
    HEADER,
    OK,
    PROOF_BYTES,
    TICKET_BYTES,
    redemption,
)
from tests.fuzz.mutate import memory_cap, mutated, share

LAYOUT = KVLayout("fuzz@1", "float32", num_layers=2, num_kv_heads=1, head_dim=2, chunk_tokens=16)
CHUNK = ChunkPlan(0, 1, 1, 0, 16)
PREFIX = CachedPrefix("", LAYOUT, 16, (CHUNK,))
SEGMENT = LAYOUT.segment_bytes(16)
OPENING = TICKET_BYTES + PROOF_BYTES


class HostileShard:
    """A listener on loopback that reads `expect` bytes of one connection, answers
    `answer` and closes."""

    def __init__(self, expect: int, answer: bytes) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.expect, self.answer = expect, answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(5)
            try:
                got = 0
                while got < self.expect and (chunk := conn.recv(self.expect - got)):
                    got += len(chunk)
                conn.sendall(self.answer)
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(1 << 16):  # until the client is done
                    pass
            except OSError:
                pass

    def close(self) -> None:
        self.thread.join(timeout=10)
        self.listener.close()


@st.composite
def fetch_streams(draw) -> tuple[torch.Tensor, torch.Tensor, bytes]:
    """K and V [layers, heads, tokens, dim] and the frames a shard sends for them."""
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(2, 1, 16, 2, generator=g) for _ in range(2))
    frames = b""
    for layer in range(2):
        segment = k[layer].numpy().tobytes() + v[layer].numpy().tobytes()
        frames += HEADER.pack(CHECKED, layer, 1, SEGMENT) + struct.pack("<I", crc32c(segment))
        frames += segment
    return k, v, frames


def fetch(answer: bytes) -> Assembly:
    """A client fetch of PREFIX's two layers from a shard that answers `answer`."""
    shard = HostileShard(OPENING, answer)
    assembly = Assembly(PREFIX, torch.zeros(2, 1, 16, 2), torch.zeros(2, 1, 16, 2), 0, 2)
    try:
        with memory_cap():
            receive(shard.address, bytes(OPENING), assembly, [CHUNK], 0, 5.0)
    finally:
        shard.close()
    return assembly


@given(fetch_streams())
def test_fetched_frames_round_trip(stream):
    k, v, frames = stream
    assembly = fetch(frames)
    assert torch.equal(assembly.k_out, k) and torch.equal(assembly.v_out, v)


@given(st.data())
def test_fetched_frame_mutations(data):
    k, v, frames = data.draw(fetch_streams())
    answer = data.draw(mutated(st.just(frames), max_edits=3))
    try:
        assembly = fetch(answer)
    except StoreError:
        return
    assert torch.equal(assembly.k_out, k) and torch.equal(assembly.v_out, v)


def error_frame(code: bytes, message: bytes, size: int | None = None) -> bytes:
    body = code + b"\n" + message
    return HEADER.pack(ERROR, 0, 0, len(body) if size is None else size) + body


@given(st.binary(max_size=40), st.binary(max_size=40), st.sampled_from([None, 2**32 - 1]))
@example(b"__class__", b"x", None)  # not a status code name
@example(b"OK", b"fine", None)
@example(b"\xff\xfe", b"\xff", 2**32 - 1)
def test_in_band_errors(code, message, size):
    try:
        fetch(error_frame(code, message, size))
    except StoreError:
        return
    raise AssertionError("an error frame was not an error")


PUT_REQUEST = OPENING + 2 * (HEADER.size + SEGMENT) + HEADER.size + 4


def put_reply(response: pb.PutResponse) -> bytes:
    body = response.SerializeToString()
    return HEADER.pack(DONE, 0, 0, len(body)) + body


def put(answer: bytes):
    """A client's data-plane put of one chunk to a shard that answers `answer`."""
    shard = HostileShard(PUT_REQUEST, answer)
    layers = [(np.zeros((1, 16, 8), np.uint8), np.ones((1, 16, 8), np.uint8))] * 2
    try:
        with memory_cap():
            return send_put(shard.address, bytes(OPENING), LAYOUT, [CHUNK], layers, 5.0)
    finally:
        shard.close()


REPLIES = st.builds(
    pb.PutResponse,
    chunk_keys=st.lists(st.integers(0, 2**64 - 1), max_size=3),
    stored_bytes=st.integers(0, 2**63 - 1),
    new_keys=st.lists(st.integers(0, 2**64 - 1), max_size=3),
)


@given(REPLIES)
def test_put_replies_round_trip(response):
    assert put(put_reply(response)) == response


@given(mutated(REPLIES.map(put_reply), max_edits=3))
@example(HEADER.pack(DONE, 0, 0, 2**32 - 1))  # a reply of 4 GiB: was allocated whole
@example(HEADER.pack(DONE, 0, 0, 3) + b"\xff\xff\xff")  # not a PutResponse: was DecodeError
def test_put_reply_mutations(answer):
    try:
        reply = put(answer)
    except StoreError:
        return
    assert isinstance(reply, pb.PutResponse)


# ---- the shard reading a client's put frames (a real shard on loopback) -----------------


@pytest.fixture(scope="module")
def puts(shard):
    """(shard server, its stub, the tenant's call metadata, its token)."""
    store, token = shard
    server = next(iter(store.servers.values()))
    with grpc.insecure_channel(server.address) as channel:
        yield (
            server,
            pb_grpc.PrefixStoreStub(channel),
            (("authorization", f"Bearer {token}"),),
            token,
        )


def put_frames(seed: int) -> bytes:
    """A well-formed data-plane put of one chunk: two layer frames and the commit."""
    g = torch.Generator().manual_seed(seed)
    segments = [torch.randn(SEGMENT // 4, generator=g).numpy().tobytes() for _ in range(2)]
    frames = b"".join(HEADER.pack(OK, i, 1, SEGMENT) + s for i, s in enumerate(segments))
    return frames + HEADER.pack(COMMIT, 0, 1, 4) + struct.pack("<I", combined_crc(segments))


def shard_answer(puts, tokens: list[int], frames: bytes) -> bytes:
    """What the shard's data plane answers to `frames` sent after an OpenPut's ticket."""
    server, stub, metadata, token = puts
    header = pb.PutHeader(layout=LAYOUT.to_proto(pb), token_ids=tokens, chunk_indices=[0])
    ticket = stub.OpenPut(header, metadata=metadata, timeout=10).ticket
    host, port = server.data_address.rsplit(":", 1)
    received = bytearray()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(redemption(ticket, token) + frames)
            sock.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                received += chunk
    return bytes(received)


def answered(answer: bytes) -> str:
    """The shard's answer: "closed", "stored", or an error's status code name."""
    if not answer:
        return "closed"
    magic, _, _, size = HEADER.unpack_from(answer)
    body = answer[HEADER.size :]
    assert len(body) == size
    if magic == DONE:
        pb.PutResponse.FromString(body)
        return "stored"
    assert magic == ERROR
    return body.decode().partition("\n")[0]


@share(0.4)
@given(st.integers(0, 2**16), st.data())
def test_shards_answer_put_frame_mutations(puts, seed, data):
    tokens = list(range(seed, seed + 16))
    frames = data.draw(mutated(st.just(put_frames(seed)), max_edits=3))
    outcome = answered(shard_answer(puts, tokens, frames))
    event(outcome)
    assert outcome not in ("INTERNAL", "UNKNOWN")
    assert answered(shard_answer(puts, tokens, put_frames(seed))) == "stored"
