"""The data-plane side of transfers a gRPC call opened: receiving a put's frames into its
session (`receive_put`, paced), and closing what a fetch ticket holds exactly once (`once`)."""

from __future__ import annotations

import struct
import threading
import time

from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.errors import InvalidArgument
from prefix_store.pace import Pace, PutBounds
from prefix_store.protocol.frames import COMMIT, DONE, HEADER, OK, read_frame_header, recv_exact


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
