"""A shard's Prometheus endpoint: scraped over real HTTP after a small workload on real
shards; authenticated; bounded tenant labels; no secret in any label or value."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from prefix_store.metrics import OTHER, MetricsConfig, TenantLabels, scrape
from tests.prefix_store.conftest import LAYOUT, random_kv

TOKEN = "metrics-secret-token"
TOKENS = list(range(500, 540))  # 16 + 16 + 8 tokens


def samples(text: str) -> dict[tuple, float]:
    """{(name, (label, value), ...): value} of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


@pytest.fixture
def shard(store):
    return store.start(metrics=MetricsConfig(port=0, token=TOKEN, tenant_labels=2))


def test_a_workload_shows_up_in_the_shard_metrics(shard, store, metadata):
    alice = metadata.add_tenant("alice")
    kv = random_kv(LAYOUT, len(TOKENS))
    with store.client(alice) as client:
        published = client.publish_prefix(TOKENS, kv, LAYOUT)
        prefix = client.lookup(TOKENS, LAYOUT)
        client.lookup([9, 9, 9] * 11, LAYOUT)  # two full chunks, both missing
        assert prefix.tokens == 40
    stub = pb_grpc.PrefixStoreStub(grpc.insecure_channel(shard.address))
    with pytest.raises(grpc.RpcError) as error:  # no layout
        stub.Lookup(
            pb.LookupRequest(token_ids=TOKENS), metadata=(("authorization", f"Bearer {alice}"),)
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    text = scrape(shard.metrics_url, TOKEN)
    got = samples(text)
    put = LAYOUT.chunk_bytes(40)
    assert published.stored_bytes == put
    assert got[("vericache_store_received_bytes_total", ("path", "put"))] == put
    assert got[("vericache_store_stored_bytes_total",)] == put
    assert got[("vericache_store_tier_bytes", ("tier", "memory"))] == put
    assert got[("vericache_store_tenant_bytes", ("tenant", "alice"))] == put
    assert got[("vericache_store_chunks",)] == 3
    assert got[("vericache_store_lookup_chunks_total", ("result", "hit"), ("tenant", "alice"))] >= 2
    assert (
        got[("vericache_store_lookup_chunks_total", ("result", "miss"), ("tenant", "alice"))] >= 1
    )
    assert got[("vericache_store_requests_total", ("code", "OK"), ("method", "Lookup"))] >= 2
    assert got[("vericache_store_requests_total", ("code", "INVALID_ARGUMENT"),
                ("method", "Lookup"))] == 1  # fmt: skip
    assert alice not in text and TOKEN not in text


def test_an_unknown_caller_is_counted_unauthenticated(shard):
    stub = pb_grpc.PrefixStoreStub(grpc.insecure_channel(shard.address))
    with pytest.raises(grpc.RpcError) as error:
        stub.Lookup(pb.LookupRequest(), metadata=(("authorization", "Bearer not-a-token"),))
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    got = samples(scrape(shard.metrics_url, TOKEN))
    key = ("vericache_store_requests_total", ("code", "UNAUTHENTICATED"), ("method", "Lookup"))
    assert got[key] == 1


def test_tenant_labels_are_bounded(shard, store, metadata):
    for name in ("alice", "bob", "carol", "dave"):
        with store.client(metadata.add_tenant(name)) as client:
            client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT)
    got = samples(scrape(shard.metrics_url, TOKEN))
    tenants = {dict(k[1:]).get("tenant") for k in got if k[0] == "vericache_store_tenant_bytes"}
    assert tenants == {"alice", "bob", OTHER}
    assert got[("vericache_store_tenant_bytes", ("tenant", OTHER))] == 2 * LAYOUT.chunk_bytes(40)


def test_the_endpoint_needs_the_token(shard):
    with pytest.raises(PermissionError):
        scrape(shard.metrics_url, "wrong")
    request = urllib.request.Request(shard.metrics_url)
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=5)
    assert error.value.code == 401
    missing = urllib.request.Request(shard.metrics_url.replace("/metrics", "/other"))
    missing.add_header("Authorization", f"Bearer {TOKEN}")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(missing, timeout=5)
    assert error.value.code == 404


def test_a_shard_without_a_metrics_config_serves_none(store):
    assert store.start().metrics_url == ""


def test_a_metrics_config_needs_a_token():
    with pytest.raises(ValueError, match="token"):
        MetricsConfig(port=0)
    assert "secret" not in repr(MetricsConfig(token="secret"))


def test_tenant_labels_keep_the_first_tenants():
    labels = TenantLabels(2)
    assert [labels(t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER, "a", OTHER, "b"]
