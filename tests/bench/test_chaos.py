"""`make chaos`, short: faults injected into a real deployment under load (shard kill -9,
a full disk tier, decoder kill -9, corruption on disk and in transit); after each the
service is healthy again, and over the run no byte was read back wrong, no sampled token
differs from full-KV decoding, no operation failed with an exception, and every shard holds
exactly the bytes it charges."""

from __future__ import annotations

import pytest

from bench.chaos import chaos_deployment, run, selected, verdict
from bench.load import LoadConfig
from prefix_store.config import MiB

pytestmark = pytest.mark.cluster

FAULTS = ["shard-kill-fetch", "disk-full", "decoder-kill", "disk-corrupt", "transit-corrupt"]


def test_faults_under_load_lose_nothing_and_recover(builtin_model, builtin_runner):
    config = LoadConfig(clients=4, tenants=2, sample=6, prefixes=2)
    faults = selected(FAULTS)  # disk-full needs root (CI is)
    disk_fs = 96 * MiB if any(f.name == "disk-full" for f in faults) else None
    with chaos_deployment(config, disk_fs) as deployment:
        result = run(config, deployment, builtin_model, builtin_runner, faults, hold_s=4)
    assert verdict(result) == []
    assert [r["fault"] for r in result["faults"]] == [f.name for f in faults]
    observed = {r["fault"]: r["observed"] for r in result["faults"]}
    assert "0 fetched layers" not in observed["transit-corrupt"]
    assert result["verified_bytes"] > 0 and result["tokens"]["checked"] > 0
