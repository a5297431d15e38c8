"""`LinkMeter`: the rate of the latest bulk reads, reads too small to be bandwidth-bound
left out (a pull priced at a round trip's rate looked about 100 times slower than it was)."""

from __future__ import annotations

import pytest

from prefix_store.client.link import BULK_BYTES, KEPT, LinkMeter


def test_no_bulk_read_no_rate():
    meter = LinkMeter()
    assert meter.bandwidth == 0.0
    meter.record(BULK_BYTES - 1, 0.001)  # a partial chunk's few tokens: one round trip
    meter.record(BULK_BYTES, 0.0)  # no time measured
    assert meter.bandwidth == 0.0


def test_the_rate_is_bytes_over_seconds_of_the_latest_reads():
    meter = LinkMeter()
    meter.record(4 * BULK_BYTES, 0.004)
    meter.record(2 * BULK_BYTES, 0.006)
    meter.record(100, 1.0)  # not counted
    assert meter.bandwidth == pytest.approx(6 * BULK_BYTES / 0.010)
    for _ in range(KEPT):  # the link got slower: only the latest reads count
        meter.record(BULK_BYTES, 1.0)
    assert meter.bandwidth == pytest.approx(BULK_BYTES)


def test_the_round_trip_is_the_least_kept():
    meter = LinkMeter()
    assert meter.round_trip_s == 0.0
    meter.record_round_trip(0.010)  # a channel's first call, with the connection's set-up
    meter.record_round_trip(0.002)
    meter.record_round_trip(0.0)  # no time measured
    assert meter.round_trip_s == 0.002
