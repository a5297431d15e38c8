"""`make load`, short: a real deployment (Ray actors, Redis, the built-in model) under
concurrent clients of several tenants; every fetched byte and every sampled lossless token
checked, no operation failing."""

from __future__ import annotations

import pytest

from bench.load import OPERATIONS, LoadConfig, deployment_for, run

pytestmark = pytest.mark.cluster


def test_a_short_load_loses_nothing_and_sends_no_wrong_token(
    redis_server, builtin_model, builtin_runner
):
    config = LoadConfig(clients=6, tenants=2, seconds=20, sample=6, prefixes=2)
    with deployment_for(config, redis_server.url) as deployment:
        summary = run(config, deployment, builtin_model, builtin_runner)
    assert summary["errors"] == {}, summary["errors"]
    assert all(summary["operations"][op]["ok"] > 0 for op in OPERATIONS), summary
    assert summary["lost_bytes"] == 0 and summary["verified_bytes"] > 0
    assert summary["tokens"]["checked"] > 0 and summary["tokens"]["wrong_tokens"] == 0
    assert set(summary["rss"]) == {"shard-0", "shard-1", "decoder-0"}
