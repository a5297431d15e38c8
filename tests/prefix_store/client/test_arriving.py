"""`Arriving`: a buffer another thread fills, read a piece at a time as each is in."""

from __future__ import annotations

import threading

import pytest

from prefix_store.client.arriving import Arriving, nbytes, pieces
from prefix_store.errors import Aborted


def test_pieces_come_as_the_bytes_arrive_and_equal_them():
    """The first piece is handed out while the producer still holds the rest back."""
    data = bytes(range(256)) * 40  # 10240 bytes
    buffer = bytearray(len(data))
    arriving = Arriving(buffer)
    first_taken = threading.Event()

    def produce() -> None:
        for start in range(0, len(data), 1000):
            if start == 5000 and not first_taken.wait(10):
                arriving.failed(AssertionError("no piece went out before all bytes were in"))
                return
            buffer[start : start + 1000] = data[start : start + 1000]
            arriving.arrived(min(len(data), start + 1000))

    producer = threading.Thread(target=produce)
    producer.start()
    got = b""
    for _, piece in pieces(arriving, 4096):
        got += bytes(piece)
        first_taken.set()
    producer.join()
    assert got == data and nbytes(arriving) == len(data)


def test_a_filling_that_fails_aborts_the_readers():
    arriving = Arriving(bytearray(100), filled=10)
    arriving.failed(ConnectionError("the peer left"))
    with pytest.raises(Aborted, match="stopped arriving: the peer left"):
        list(pieces(arriving, 50))


def test_plain_bytes_are_pieces_at_once():
    assert [bytes(p) for _, p in pieces(b"abcdefg", 3)] == [b"abc", b"def", b"g"]
