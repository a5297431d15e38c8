"""The data-plane side of transfers a gRPC call opened: receiving a put's frames into its
session (`receive_put`, paced) or an artifact into its buffer (`receive_artifact`), and
closing what a ticket holds exactly once (`once`)."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable

import numpy as np
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store import faults
from prefix_store.blob import crc32c
from prefix_store.errors import InvalidArgument, Unavailable
from prefix_store.pace import Pace, PutBounds
from prefix_store.protocol.frames import (
    CHECKED,
    COMMIT,
    DONE,
    HEADER,
    OK,
    pack_crcs,
    read_frame_header,
    recv_exact,
    send_buffers,
)
from prefix_store.shard import Reservation
from prefix_store.shard.arrival import ArrivalCheck

ARTIFACT_PIECE = 1 << 20
"""An artifact's bytes are received (each piece first held in the receive budget) or sent,
and checked, this many at a time."""


def once(*actions):
    """A callable that runs `actions` in order the first time it is called, never again."""
    lock, done = threading.Lock(), []

    def run() -> None:
        with lock:
            if done:
                return
            done.append(True)
        run_all(actions)

    return run


def run_all(actions) -> None:
    """Each of `actions` in order, the later ones even when an earlier one raised."""
    if actions:
        try:
            actions[0]()
        finally:
            run_all(actions[1:])


def receive_put(conn, session, bounds: PutBounds) -> None:
    """The data-plane side of OpenPut: every layer frame straight into the session's
    buffers, then the commit frame; answers with the PutResponse. The transfer keeps to
    `bounds` (`pace`): one past its deadline or below its minimum rate is cut with a
    DEADLINE_EXCEEDED frame."""
    layout = session.layout
    pace = Pace(bounds, session.total_bytes)
    idle = conn.gettimeout()
    for layer in range(layout.num_layers):
        magic, got, chunks, size = read_frame_header(conn)
        if (magic, got, chunks, size) != (OK, layer, len(session.indices), session.layer_bytes):
            raise InvalidArgument(
                f"frame: expected layer {layer} of {len(session.indices)} chunks "
                f"({session.layer_bytes} bytes), got {(magic, got, chunks, size)}"
            )
        for chunk, view in session.layer_pieces(layer):
            recv_paced(conn, view, pace, idle)
            session.arrived(chunk, layer, view)
    magic, _, chunks, size = read_frame_header(conn)
    if magic != COMMIT or chunks != len(session.indices) or size != 4 * chunks:
        raise InvalidArgument("frame: expected the commit frame with one CRC-32C per chunk")
    crcs = bytearray(size)
    recv_exact(conn, memoryview(crcs))
    done = session.commit(list(struct.unpack(f"<{chunks}I", crcs)))
    reply = pb.PutResponse(
        chunk_keys=done.keys, stored_bytes=done.new_bytes, new_keys=done.new_keys
    ).SerializeToString()
    conn.sendall(HEADER.pack(DONE, 0, 0, len(reply)) + reply)


def receive_artifact(
    conn, held: Reservation, bounds: PutBounds, store: Callable[..., pb.PutResponse]
) -> None:
    """The data-plane side of OpenPutArtifact: one frame of the declared size straight into
    the artifact's final buffer (each piece held in the receive budget first, its CRC-32C
    and digest computed as it lands), then the commit frame with the CRC-32C; `store(data,
    check)` keeps it and its PutResponse is the answer. Paced as `receive_put`."""
    size = held.declared
    magic, layer, chunks, got = read_frame_header(conn)
    if (magic, layer, chunks, got) != (OK, 0, 1, size):
        raise InvalidArgument(
            f"frame: expected the artifact's {size} bytes, got {(magic, layer, chunks, got)}"
        )
    pace, idle = Pace(bounds, size), conn.gettimeout()
    buffer = memoryview(np.empty(size, dtype=np.uint8))
    check = ArrivalCheck(1, size)
    for start in range(0, size, ARTIFACT_PIECE):
        piece = buffer[start : start + ARTIFACT_PIECE]
        held.grow(len(piece))
        recv_paced(conn, piece, pace, idle)
        check.arrived(0, piece, buffer)
    magic, _, chunks, size = read_frame_header(conn)
    if magic != COMMIT or chunks != 1 or size != 4:
        raise InvalidArgument("frame: expected the commit frame with the artifact's CRC-32C")
    crc = bytearray(4)
    recv_exact(conn, memoryview(crc))
    if struct.unpack("<I", crc)[0] != check.crcs[0]:
        raise InvalidArgument("crc32c: the artifact arrived corrupted")
    held.release()  # the store checks quota and room itself, under the shard's lock
    reply = store(buffer.toreadonly(), check).SerializeToString()
    conn.sendall(HEADER.pack(DONE, 0, 0, len(reply)) + reply)


def send_artifact(conn, read) -> None:
    """The data-plane side of OpenFetchArtifact: one CHECKED frame, the stored CRC-32C then
    the bytes, checked against it as they are sent, a piece at a time while it is in cache
    (`shard.artifacts.ArtifactRead`). The stored bytes are never trusted unchecked: the
    client checks the same CRC-32C before it uses any byte, and a mismatch found here drops
    the artifact (`DataLoss`, so a later read is a miss or another replica's)."""
    data = memoryview(read.data()).cast("B")
    if data.nbytes != read.size:
        raise Unavailable("the artifact was replaced while its ticket waited; ask again")
    conn.sendall(HEADER.pack(CHECKED, 0, 1, data.nbytes) + pack_crcs([read.crc]))
    crc = 0
    for start in range(0, data.nbytes, ARTIFACT_PIECE):
        piece = data[start : start + ARTIFACT_PIECE]
        crc = crc32c(piece, crc)
        send_buffers(conn, faults.TRANSIT.tamper([piece]))
    read.check(crc)


def recv_paced(conn, view: memoryview, pace: Pace, idle: float | None) -> None:
    """Fill a flat view from `conn`, counting what arrives against `pace`: waits no longer
    than the pace allows (DeadlineExceeded) nor than `idle` (the socket's timeout)."""
    while view.nbytes:
        wait = max(0.001, pace.due() - time.monotonic())
        conn.settimeout(wait if idle is None else min(idle, wait))
        try:
            n = conn.recv_into(view)
        except TimeoutError:
            pace.check()
            if idle is not None and wait >= idle:
                raise
            continue
        if n == 0:
            raise ConnectionError("the peer closed the data connection mid-transfer")
        view = view[n:]
        pace.arrived(n)
