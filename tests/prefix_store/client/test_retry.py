"""The client's retry policy (`Attempts`, no I/O) on a busy refusal from the data plane
(`LimitExceeded`): for puts it waits at least what a busy server asks, never quarantines
the shard, and reports the refusal itself, not UNAVAILABLE, when every attempt was
refused; for anything else it is raised at once."""

from __future__ import annotations

from dataclasses import replace

import pytest
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.client.core import ClientCore
from prefix_store.client.retry import Attempts, retrying
from prefix_store.config import ClientConfig
from prefix_store.errors import LimitExceeded, Unavailable
from prefix_store.status import BUSY_RETRY_MS

CONFIG = ClientConfig(retries=3, backoff_s=0.001, max_backoff_s=0.002)


def test_a_busy_refusal_waits_without_quarantine_and_is_reported_as_such():
    quarantined = []
    attempts = Attempts(CONFIG, ["shard-0"], quarantined.append, wait_when_busy=True)
    refusal = LimitExceeded("data plane: the shard's connections are taken")
    waits = []
    for target in attempts:
        waits.append(attempts.failed(target, refusal))
    assert waits[:-1] == [BUSY_RETRY_MS / 1000] * 2 and quarantined == []
    assert attempts.exhausted() is refusal


def test_retrying_tries_again_after_a_busy_refusal():
    answers = iter([LimitExceeded("busy"), "stored"])

    def call(target: str) -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert retrying(Attempts(CONFIG, ["shard-0"], wait_when_busy=True), call) == "stored"


def test_without_waiting_a_busy_refusal_is_raised_at_once():
    """Fetches move to a replica instead (`fetch_artifact`, `ArtifactSearch`)."""
    calls = []

    def call(target: str) -> str:
        calls.append(target)
        raise LimitExceeded("busy")

    with pytest.raises(LimitExceeded):
        retrying(Attempts(CONFIG, ["shard-0"]), call)
    assert calls == ["shard-0"]


def described(*shards: str) -> pb.DescribeResponse:
    infos = [pb.ShardInfo(shard_id=s, address=f"{s}.test:7000") for s in shards]
    return pb.DescribeResponse(tenant="alice", shards=infos, replication=2)


def test_a_shard_that_left_the_membership_since_the_call_was_planned_is_moved_on_from():
    """A call plans its attempts from the topology it saw; a refresh on another thread may
    drop a shard before the call reaches it (chaos: a shard killed during puts). Its address
    is then Unavailable, as an unreachable shard's, and the call goes on to the replica
    instead of failing with a KeyError."""
    core = ClientCore("shard-0.test:7000", replace(CONFIG, membership_grace_s=0))
    core.observe(described("shard-0", "shard-1"))
    attempts = core.attempts(["shard-0", "shard-1"])
    core.observe(described("shard-1"))  # shard-0 gone, after the attempts were planned
    assert "shard-0" not in core.topology.shards
    with pytest.raises(Unavailable, match="shard-0 left the membership"):
        core.address("shard-0")
    assert retrying(attempts, core.address) == "shard-1.test:7000"
