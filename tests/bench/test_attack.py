"""`make attack`, short: a real deployment (Ray actors, Redis, the router, the LMCache
gateway, the built-in model) with a victim tenant's checked load beside each attack of
issue 26 in turn. What is asserted is the benchmark itself: every phase ran, the victim did
checked work, every attack did what it says (streams opened, bytes sent, connections
held, refusals received), and the verdict names a target that does not hold. Latency
targets are the benchmark's to judge, not this test's."""

from __future__ import annotations

import copy
import os

import pytest

from bench.attack import ATTACKS, AttackConfig, attack_deployment, run, verdict

pytestmark = pytest.mark.cluster

DID = {
    "2": ("streams opened", "bytes sent"),
    "3": ("streams opened", "bytes declared"),
    "4": ("streams opened",),
    "5": ("tickets issued", "connections opened"),
    "6": ("unknown tokens sent", "bytes sent"),
    "8": ("256 MiB PUTs opened",),
    "10": ("slow connections opened",),
}


def test_every_attack_runs_beside_a_checked_victim(redis_server, builtin_model, builtin_runner):
    config = AttackConfig(seconds=3, rate=3, attack_rate=10, new_tokens=4, decoder_threads=1)
    with attack_deployment(config, redis_server.url) as deployment:
        result = run(config, deployment, builtin_model, builtin_runner)
    phases = {p["phase"]: p for p in result["phases"]}
    assert list(phases) == ["baseline", "benign"] + [f"attack {f}" for f in ATTACKS]
    assert sum(p["tokens"]["checked"] for p in phases.values()) > 0
    assert sum(p["verified_bytes"] for p in phases.values()) > 0
    assert all(p["ops"] > 0 and p["tokens"]["wrong_tokens"] == 0 for p in phases.values())
    assert phases["benign"]["did"]["operations"] > 0
    for finding, keys in DID.items():
        did = phases[f"attack {finding}"]["did"]
        assert all(did.get(k, 0) > 0 for k in keys), (finding, did)
    if os.geteuid() == 0:  # another local user's connections to the gateway, closed at once
        gateway = phases["attack 8"]["did"]
        assert gateway.get("foreign uid 65534: connections cut", 0) > 0, gateway
    assert set(result["bounds"]) == {"shard-0", "shard-1", "decoder-0"}
    assert all(set(p["healthy"]) >= {"lmcache-gateway"} for p in phases.values())
    # The verdict machinery: a failed operation, a p99 over twice the benign phase's, an
    # unhealthy component and a shard over its RSS bound are each named.
    broken = copy.deepcopy(result)
    attacked = broken["phases"][2]
    attacked["failed"] = {"RESOURCE_EXHAUSTED": 1}
    attacked["p99_s"] = 3 * broken["phases"][1]["p99_s"] + 1
    attacked["healthy"]["lmcache-gateway"] = "OSError: refused"
    attacked["rss_peak"]["shard-0"] = broken["bounds"]["shard-0"] + 1
    missed = " | ".join(verdict(broken))
    for words in ("failed", "x benign", "unhealthy", "shard-0 RSS"):
        assert words in missed, missed
