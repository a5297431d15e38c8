"""What a client makes of the data plane's in-band error frames (the shard's own frames,
over a real socket pair): a refusal the shard marked busy is `LimitExceeded` (wait and try
again), on a put as on a fetch; an unmarked RESOURCE_EXHAUSTED on a put is the tenant's
quota or a full store, which waiting does not cure."""

from __future__ import annotations

import socket

import pytest

from prefix_store.client.transfer import in_band_error
from prefix_store.errors import LimitExceeded, NotFound, QuotaExceeded
from prefix_store.protocol.frames import ERROR, error_frame, read_error, read_frame_header
from prefix_store.status import BUSY_RETRY_MS


def received(frame: bytes, fetch: bool):
    """The typed error a client reads from `frame`."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(frame)
        magic, hint, _, size = read_frame_header(ours)
        assert magic == ERROR
        return in_band_error(ours, size, hint, fetch=fetch)


@pytest.mark.parametrize("fetch", [False, True], ids=["put", "fetch"])
def test_a_refusal_marked_busy_is_limit_exceeded(fetch):
    frame = error_frame("RESOURCE_EXHAUSTED", "the shard's connections are taken", BUSY_RETRY_MS)
    error = received(frame, fetch)
    assert isinstance(error, LimitExceeded) and "connections are taken" in str(error)


def test_an_unmarked_resource_exhausted_put_is_the_quota():
    error = received(error_frame("RESOURCE_EXHAUSTED", "over quota"), fetch=False)
    assert isinstance(error, QuotaExceeded) and not isinstance(error, LimitExceeded)


def test_other_codes_keep_their_error():
    assert isinstance(received(error_frame("NOT_FOUND", "gone"), fetch=False), NotFound)


def test_a_reader_before_the_mark_still_reads_the_code_and_message():
    """The busy mark rides in the header's layer field, which readers before it ignore."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(error_frame("RESOURCE_EXHAUSTED", "busy", BUSY_RETRY_MS))
        _, _, _, size = read_frame_header(ours)
        assert read_error(ours, size) == ("RESOURCE_EXHAUSTED", "busy", None)
