"""`make chaos`, short: faults injected into a real deployment under load (shard kill -9,
a full disk tier, decoder kill -9, corruption on disk, in transit and in near-data
partials), its decoders verifying near the data (`--placement near`: every fault meets
Attend streams too); each proves it took
effect by what was measured in its window, the service is healthy again after each, and
over the run no byte was read back wrong, no lossless token differs from full-KV decoding,
no committed prefix went missing unexplained, no operation failed with a status its window
does not expect, and every shard holds exactly the bytes it charges: `verdict` is empty."""

from __future__ import annotations

import json

import pytest

from bench.chaos import chaos_deployment, run, selected, verdict
from bench.load import LoadConfig

pytestmark = pytest.mark.cluster

FAULTS = [
    "shard-kill-fetch",
    "disk-full",
    "decoder-kill",
    "disk-corrupt",
    "transit-corrupt",
    "attend-corrupt",
]


def test_faults_under_load_prove_themselves_lose_nothing_and_recover(builtin_model, builtin_runner):
    config = LoadConfig(clients=4, tenants=2, prefixes=2, decoder_threads=1, placement="near")
    faults = selected(FAULTS, config.placement)  # disk-full needs root (CI is)
    own_disk = any(f.name == "disk-full" for f in faults)
    with chaos_deployment(config, own_disk) as deployment:
        result = run(config, deployment, builtin_model, builtin_runner, faults, hold_s=4)
    problems = verdict(result)
    assert problems == [], f"{problems}\n{json.dumps(result['faults'], indent=1)}"
    assert [r["fault"] for r in result["faults"]] == [f.name for f in faults]
    evidence = {r["fault"]: r["evidence"] for r in result["faults"]}
    assert evidence["transit-corrupt"]["transit_detected"] > 0
    assert evidence["disk-corrupt"]["detected"] > 0
    assert evidence["decoder-kill"]["in_flight"] > 0
    assert evidence["attend-corrupt"]["corrupted_partials"] > 0
    near = [r["evidence"]["near_generations"] for r in result["faults"]]
    assert result["calm"]["near_generations"] > 0 and sum(near) > 0, near
