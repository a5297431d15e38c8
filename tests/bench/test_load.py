"""`make load`, short: a real deployment (Ray actors, Redis, the built-in model) under
concurrent clients of several tenants; every fetched byte and every lossless token
checked, every committed prefix read back, no operation failing: `verdict` finds nothing."""

from __future__ import annotations

import pytest

from bench.load import LoadConfig, deployment_for, run, verdict

pytestmark = pytest.mark.cluster


def test_a_short_load_loses_nothing_and_sends_no_wrong_token(
    redis_server, builtin_model, builtin_runner
):
    config = LoadConfig(clients=6, tenants=2, seconds=20, prefixes=2, decoder_threads=1)
    with deployment_for(config, redis_server.url) as deployment:
        summary = run(config, deployment, builtin_model, builtin_runner)
    assert verdict(summary) == []
    assert summary["sweep"]["prefixes"] >= config.tenants * config.prefixes
    assert summary["sweep"]["misses"] == 0 and summary["losses"]["missed_prefixes"] == 0
    assert set(summary["rss"]) == {"shard-0", "shard-1", "decoder-0"}
