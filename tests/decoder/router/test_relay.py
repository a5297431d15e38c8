"""The relay's splice rules, alone: a decoder taking a request over must repeat what was
sent; with stop strings it may end a little earlier than the one before did (where a stop
string is seen depends on how verified tokens are grouped into events)."""

from __future__ import annotations

import pytest
from vericache.v1 import decoder_pb2 as dpb

from decoder.router.relay import Diverged, Relay


def relay(stop_strings: bool) -> Relay:
    r = Relay(None, list, b"", (), 3, stop_strings=stop_strings)
    r.sent, r.text = [5, 6, 7, 8], "abcd"
    return r


def done(reason: str) -> dpb.GenerateEvent:
    return dpb.GenerateEvent(done=dpb.Done(stop_reason=reason, stats_json="{}"))


def test_a_takeover_that_ends_early_is_data_loss_without_stop_strings():
    with pytest.raises(Diverged):
        relay(False)._done(done("stop"), [5, 6, 7])
    with pytest.raises(Diverged):
        relay(True)._done(done("length"), [5, 6, 7])


def test_with_stop_strings_a_takeover_may_end_at_its_own_stop():
    event = relay(True)._done(done("stop"), [5, 6, 7])
    assert event.done.stop_reason == "stop"


def test_a_takeover_must_repeat_the_tokens_already_sent():
    with pytest.raises(Diverged):
        relay(True)._fresh([5, 9], "ax")
    r = relay(True)
    assert r._fresh([5, 6], "ab") is None
    assert list(r._fresh([5, 6, 7, 8, 9], "abcde").tokens.ids) == [9]
