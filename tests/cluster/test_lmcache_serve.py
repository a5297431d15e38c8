"""`vericache serve --lmcache-port`: the deployment starts the LMCache gateway (a Ray actor)
as its `lmcache` tenant; LMCache's own connector round-trips through it bitwise; its
metrics endpoint counts what it did; `status` lists it."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.cli import main
from cluster.state import read_state
from prefix_store.config import MiB
from prefix_store.metrics import scrape
from tests.cluster.conftest import deployed
from tests.prefix_store.test_lmcache_gateway import LMCacheClient, key, same

pytestmark = pytest.mark.cluster


def test_serve_starts_a_gateway_that_lmcache_uses(redis_server, tmp_path, metadata, capsys):
    with deployed(
        redis_server.url, tmp_path, shards=1, memory_bytes=256 * MiB, disk_bytes=0,
        decoders=0, lmcache_port=0,
    ) as deployment:  # fmt: skip
        assert read_state()["lmcache"] == f"lm://{deployment.lmcache}"
        assert metadata.tenant("lmcache") is not None  # the tenant it acts as
        lmc = LMCacheClient(deployment.lmcache)
        try:
            obj = lmc.object(256, seed=3)
            lmc.put(key(1), obj)
            got = lmc.get(key(1))
            assert got is not None and same(got, obj)
            assert lmc.get(key(2)) is None
        finally:
            lmc.close()
        url = deployment.metrics["lmcache-gateway"]
        text = scrape(url, deployment.metrics_token)
        got = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                got[(s.name, *sorted(s.labels.items()))] = s.value
        requests = "vericache_gateway_requests_total"
        assert got[(requests, ("command", "put"), ("result", "stored"))] == 1
        assert got[(requests, ("command", "get"), ("result", "hit"))] == 1
        assert got[(requests, ("command", "get"), ("result", "miss"))] == 1
        assert got[("vericache_gateway_received_bytes_total",)] > 0
        capsys.readouterr()
        assert main(["status", "--json"]) == 0
        live = json.loads(capsys.readouterr().out)["live"]
        assert live["lmcache-gateway"]["requests"] >= 3
        assert live["lmcache-gateway"].get("errors", 0) == 0
