"""The client side of the shard's bulk data plane (see prefix_store/data_plane.py): redeem
a ticket and receive every frame straight into the caller's tensors."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Sequence

from prefix_store.client.plan import Assembly, ChunkPlan
from prefix_store.data_plane import ERROR, HEADER, OK, tune
from prefix_store.errors import DataLoss, NotFound, Unavailable


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill a flat (format "B") view."""
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the shard closed the data connection mid-transfer")
        view = view[n:]


class Cancel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def cancel(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def receive(
    address: str,
    ticket: bytes,
    assembly: Assembly,
    chunks: Sequence[ChunkPlan],
    layer_from: int,
    timeout_s: float,
    track: Callable[[object], None] | None = None,
) -> None:
    """Redeem `ticket` at `address` and write layers [layer_from, end) of `chunks` into
    the assembly. Socket failures raise Unavailable; an in-band error raises DataLoss
    (corrupt on the shard) or NotFound. `track` receives an object whose `cancel()` cuts
    the connection, so that nothing is written into the outputs after a cancel."""
    layout = assembly.prefix.layout
    layers = assembly.layer_end - layer_from
    expected = sum(layout.segment_bytes(c.tokens) for c in chunks)
    header = bytearray(HEADER.size)
    try:
        with socket.create_connection(host_port(address), timeout=timeout_s) as sock:
            tune(sock)
            if track is not None:
                track(Cancel(sock))
            sock.sendall(ticket)
            for step in range(layers):
                recv_exact(sock, memoryview(header))
                magic, layer, count, size = HEADER.unpack(header)
                if magic == ERROR:
                    message = bytearray(size)
                    recv_exact(sock, memoryview(message))
                    text = message.decode(errors="replace")
                    raise (DataLoss if "checksum" in text else NotFound)(f"data plane: {text}")
                if (magic, layer, count, size) != (OK, layer_from + step, len(chunks), expected):
                    raise Unavailable(
                        f"data plane: unexpected frame from {address}: "
                        f"{(magic, layer, count, size)} != {(OK, layer_from + step, len(chunks), expected)}"
                    )
                for view in assembly.layer_views(chunks, layer):
                    recv_exact(sock, view)
                assembly.mark_layer(chunks, layer, size)
    except OSError as error:
        raise Unavailable(f"data plane {address}: {error}") from error
