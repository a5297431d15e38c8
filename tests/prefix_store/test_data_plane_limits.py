"""The data plane under hostile or broken clients: it survives running out of file
descriptors, cuts idle and too-slow connections, shares connections and tickets fairly (no
tenant, nor any unauthenticated peer, can take them all), and lets a ticket be redeemed
only from the address it was issued to. A real listener on loopback, raw sockets as
clients (a second loopback address, 127.0.0.2, plays another host)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import socket
import threading
import time

import pytest

from prefix_store.config import DataPlaneLimits
from prefix_store.data_plane import DataPlane
from prefix_store.errors import LimitExceeded
from prefix_store.protocol.frames import HEADER, InBandError, read_error, redemption, token_key
from prefix_store.status import BUSY_RETRY_MS
from tests.waiting import eventually


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


def connect(plane: DataPlane, timeout: float = 5.0, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(
        ("127.0.0.1", plane.port), timeout=timeout, source_address=(source, 0)
    )
    sock.settimeout(timeout)
    return sock


def answer(sock: socket.socket) -> InBandError:
    """The error frame the plane sends back."""
    header = sock.recv(HEADER.size, socket.MSG_WAITALL)
    _, retry_after_ms, _, size = HEADER.unpack(header)
    return read_error(sock, size, retry_after_ms)


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


def fill_descriptor_table() -> list[int]:
    """Open /dev/null until the process has no file descriptor left (EMFILE); the caller
    closes what it returns."""
    filled: list[int] = []
    with contextlib.suppress(OSError):
        while True:
            filled.append(os.open(os.devnull, os.O_RDONLY))
    return filled


def test_the_accept_loop_survives_running_out_of_file_descriptors(plane_with):
    """A connection waits in the listen backlog while the process has no descriptor left:
    the plane's accept() fails with EMFILE (counted), it backs off, and it accepts and
    answers that connection once descriptors are free again."""
    plane = plane_with()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    waiting = socket.socket()  # its descriptor taken before the table fills
    filled: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        filled = fill_descriptor_table()
        waiting.connect(("127.0.0.1", plane.port))  # the kernel completes it: backlogged
        met = eventually(lambda: plane.accept_errors > 0, timeout_s=10)
    finally:
        for fd in filled:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert filled, "the descriptor table was never filled"
    assert met, "the plane's accept() never met EMFILE"
    with waiting:  # accepted once descriptors are free, and answered
        waiting.settimeout(10)
        waiting.sendall(b"x" * 48)
        assert answer(waiting) == ("UNAVAILABLE", "unknown or expired ticket", None)
    with connect(plane) as sock:  # still accepting, still answering
        sock.sendall(b"x" * 48)
        assert answer(sock) == ("UNAVAILABLE", "unknown or expired ticket", None)


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


def test_unauthenticated_connections_cannot_take_every_connection(plane_with):
    """A peer that opens connections and sends nothing (finding 5): it holds at most its
    share of the connections still opening, each for the handshake deadline only, while
    another host's tenant redeems its ticket at once; a client at the hostile peer's own
    address takes over its oldest idle slot, and redeems too."""
    plane = plane_with(max_opening=8, opening_per_peer=4, handshake_s=3.0, idle_s=60.0)
    hostile = [connect(plane) for _ in range(4)]
    try:
        neighbour = threading.Event()
        ticket = plane.issue(lambda conn: neighbour.set(), lambda: None, tenant="neighbour")
        with connect(plane) as fifth:  # the same address: over its limit of 4
            fifth.sendall(redemption(ticket, "any"))
            assert neighbour.wait(5)
        assert closed_within(hostile[0], 2)  # the oldest idle one gave up its slot
        assert not any(closed_within(sock, 0.2) for sock in hostile[1:])
        ran = threading.Event()
        ticket = plane.issue(lambda conn: ran.set(), lambda: None, "127.0.0.2", tenant="victim")
        with connect(plane, source="127.0.0.2") as sock:
            sock.sendall(redemption(ticket, "any"))
            assert ran.wait(5)
        start = time.monotonic()
        assert all(closed_within(sock, 10) for sock in hostile[1:])  # the handshake deadline
        assert time.monotonic() - start < 8  # not the idle timeout (60 s)
    finally:
        for sock in hostile:
            sock.close()


def test_a_tenant_holds_at_most_its_share_of_transfer_connections(plane_with):
    plane = plane_with(max_connections=4)
    release = threading.Event()
    running = []

    def run(conn: socket.socket) -> None:
        running.append(1)
        release.wait(10)

    tickets = [plane.issue(run, lambda: None, tenant="hog") for _ in range(3)]
    socks = [connect(plane) for _ in tickets]
    try:
        for sock, ticket in zip(socks[:2], tickets[:2], strict=True):
            sock.sendall(redemption(ticket, "any"))
        assert eventually(lambda: len(running) >= 2, timeout_s=5)
        assert len(running) == 2  # alone: 4 less a newcomer's share
        socks[2].sendall(redemption(tickets[2], "any"))
        code, message, retry_after_ms = answer(socks[2])
        assert code == "RESOURCE_EXHAUSTED" and "data-plane connections" in message
        assert retry_after_ms == BUSY_RETRY_MS  # busy, not over a quota: try again later
        other = threading.Event()
        ticket = plane.issue(lambda conn: other.set(), lambda: None, tenant="other")
        with connect(plane) as sock:  # another tenant still finds a connection
            sock.sendall(redemption(ticket, "any"))
            assert other.wait(5)
    finally:
        release.set()
        for sock in socks:
            sock.close()


def test_one_tenant_refreshing_tickets_cannot_take_them_all(plane_with):
    """A tenant that keeps asking for tickets (cheap OpenFetch calls) gets its share of
    them; another tenant still gets tickets, and redeemed or expired ones are given back."""
    plane = plane_with(max_tickets=8, ticket_ttl_s=1.0)
    closed = []
    issued = []
    with pytest.raises(LimitExceeded, match=r"'hog'.*data-plane tickets.*fair share is 4 of 8"):
        while True:
            issued.append(plane.issue(lambda conn: None, lambda: closed.append(1), tenant="hog"))
    assert len(issued) == 4
    for name in ("victim", "another"):
        plane.issue(lambda conn: None, lambda: None, tenant=name)
    # they expire (the reaper closes them): the hog may ask again
    assert eventually(lambda: len(closed) >= 4, timeout_s=10)
    assert len(closed) == 4
    plane.issue(lambda conn: None, lambda: None, tenant="hog")


def test_a_heavier_tenant_gets_more_tickets(plane_with):
    """Two tenants asking in turn: weight 2 gets twice the tickets of weight 1."""
    plane = plane_with(max_tickets=12)
    weights = {"heavy": 2.0, "light": 1.0}
    counts = dict.fromkeys(weights, 0)
    going = set(weights)
    while going:
        for name in sorted(going):
            try:
                plane.issue(lambda conn: None, lambda: None, tenant=name, weight=weights[name])
                counts[name] += 1
            except LimitExceeded:
                going.discard(name)
    assert counts == {"heavy": 6, "light": 3}  # 12 * 2/4 and 12 * 1/4: a newcomer's 3 free


def test_a_ticket_is_redeemable_only_from_its_address(plane_with):
    plane = plane_with()
    ran = threading.Event()
    elsewhere = plane.issue(lambda conn: ran.set(), lambda: None, peer="10.9.9.9")
    with connect(plane) as sock:  # a sniffed ticket, redeemed from another address
        sock.sendall(redemption(elsewhere, "any"))
        assert answer(sock) == ("UNAVAILABLE", "unknown or expired ticket", None)
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
            assert answer(sock) == ("UNAVAILABLE", "unknown or expired ticket", None)
    assert not ran.is_set()
    with connect(plane) as sock:
        sock.sendall(redemption(ticket, "alice"))
        assert ran.wait(5)
    # What Redis stores of a token (its SHA-256) does not make the proof.
    assert token_key("alice") != hashlib.sha256(b"alice").digest()
