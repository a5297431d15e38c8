"""The data plane under hostile or broken clients: it survives running out of file
descriptors, cuts idle and too-slow connections, caps connections and tickets, and lets a
ticket be redeemed only from the address it was issued to. A real listener on loopback,
raw sockets as clients."""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import socket
import threading
import time

import pytest

from prefix_store.data_plane import (
    HEADER,
    DataPlane,
    DataPlaneLimits,
    read_error,
    redemption,
    token_key,
)
from prefix_store.errors import StoreFull


@pytest.fixture
def plane_with():
    planes = []

    def start(**limits) -> DataPlane:
        plane = DataPlane("127.0.0.1", 0, DataPlaneLimits(**limits))
        plane.start()
        planes.append(plane)
        return plane

    yield start
    for plane in planes:
        plane.stop()


def connect(plane: DataPlane, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", plane.port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def answer(sock: socket.socket) -> tuple[str, str]:
    """The error frame the plane sends back (code, message)."""
    header = sock.recv(HEADER.size, socket.MSG_WAITALL)
    _, _, _, size = HEADER.unpack(header)
    return read_error(sock, size)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


def test_the_accept_loop_survives_running_out_of_file_descriptors(plane_with):
    plane = plane_with()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    opened: list[socket.socket] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        with contextlib.suppress(OSError):
            for _ in range(64):
                opened.append(socket.create_connection(("127.0.0.1", plane.port), timeout=1))
        time.sleep(0.5)  # the plane's accept() meets EMFILE meanwhile
    finally:
        for sock in opened:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(opened) < 64, "the descriptor limit was never reached"
    with connect(plane) as sock:  # still accepting, still answering
        sock.sendall(b"x" * 48)
        assert answer(sock) == ("UNAVAILABLE", "unknown or expired ticket")


def test_a_connection_that_sends_no_ticket_is_closed_when_idle(plane_with):
    plane = plane_with(idle_s=1.0)
    with connect(plane) as sock:
        start = time.monotonic()
        assert closed_within(sock, 10)
        assert time.monotonic() - start < 5


def test_a_too_slow_reader_is_cut_at_its_deadline_and_its_transfer_released(plane_with):
    plane = plane_with(idle_s=30.0, deadline_s=1.0)
    released = threading.Event()

    def run(conn: socket.socket) -> None:
        block = bytes(1 << 20)
        for _ in range(512):  # 512 MiB: far more than the socket buffers hold
            conn.sendall(block)

    ticket = plane.issue(run, released.set)
    with connect(plane) as sock:
        sock.sendall(redemption(ticket, "any"))
        sock.recv(1024)  # reads a little, then stalls
        start = time.monotonic()
        assert released.wait(15), "the stalled transfer was never cut"
        assert time.monotonic() - start < 10  # the idle timeout (30 s) did not do it


def test_connections_beyond_the_cap_are_told_so(plane_with):
    plane = plane_with(max_connections=2)
    with connect(plane), connect(plane):
        time.sleep(0.2)
        with connect(plane) as third:
            assert answer(third) == ("UNAVAILABLE", "data plane: too many connections")


def test_outstanding_tickets_are_capped(plane_with):
    plane = plane_with(max_tickets=2)
    released = []
    for _ in range(2):
        plane.issue(lambda conn: None, lambda: released.append(1))
    with pytest.raises(StoreFull, match="max_tickets 2"):
        plane.issue(lambda conn: None, lambda: None)


def test_a_ticket_is_redeemable_only_from_its_address(plane_with):
    plane = plane_with()
    ran = threading.Event()
    elsewhere = plane.issue(lambda conn: ran.set(), lambda: None, peer="10.9.9.9")
    with connect(plane) as sock:  # a sniffed ticket, redeemed from another address
        sock.sendall(redemption(elsewhere, "any"))
        assert answer(sock) == ("UNAVAILABLE", "unknown or expired ticket")
    assert not ran.is_set()
    here = plane.issue(lambda conn: ran.set(), lambda: None, peer="127.0.0.1")
    with connect(plane) as sock:
        sock.sendall(redemption(here, "any"))
        assert ran.wait(5)


def test_a_ticket_is_redeemable_only_by_its_tenant(plane_with):
    """A ticket that leaks (no TLS) is worthless without its tenant's token."""
    plane = plane_with()
    ran = threading.Event()
    ticket = plane.issue(lambda conn: ran.set(), lambda: None, owner_key=token_key("alice"))
    for thief in (ticket + bytes(32), redemption(ticket, "mallory")):
        with connect(plane) as sock:
            sock.sendall(thief)
            assert answer(sock) == ("UNAVAILABLE", "unknown or expired ticket")
    assert not ran.is_set()
    with connect(plane) as sock:
        sock.sendall(redemption(ticket, "alice"))
        assert ran.wait(5)
    # What Redis stores of a token (its SHA-256) does not make the proof.
    assert token_key("alice") != hashlib.sha256(b"alice").digest()
