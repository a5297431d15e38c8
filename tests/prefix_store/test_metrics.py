"""A shard's Prometheus endpoint: scraped over real HTTP after a small workload on real
shards; authenticated; bounded tenant labels; no secret in any label or value."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from prefix_store.metrics import OTHER, MetricsConfig, MetricsServer, TenantLabels, scrape
from tests.prefix_store.conftest import LAYOUT, random_kv
from tests.waiting import eventually

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


@pytest.fixture
def endpoint(request):
    """A metrics endpoint serving 4 connections at once (a peer alone: 2), each for at
    most the test's `deadline_s` (its parameter)."""
    config = MetricsConfig(token=TOKEN, max_connections=4, timeout_s=request.param)
    server = MetricsServer(CollectorRegistry(), config)
    server.start()
    yield server
    server.stop()


def slow_client(server: MetricsServer) -> socket.socket:
    """A connection that has sent half a request line and then nothing."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"GET /metr")
    return sock


@pytest.mark.parametrize("endpoint", [60.0], indirect=True)
def test_connections_over_the_limit_are_refused_at_accept_without_a_thread(endpoint):
    idle = threading.active_count()
    held = [slow_client(endpoint) for _ in range(2)]
    threads = idle + 4  # each held connection: its thread and its deadline's timer
    assert eventually(lambda: threading.active_count() == threads)
    extra = [socket.create_connection(("127.0.0.1", endpoint.port)) for _ in range(20)]
    assert eventually(lambda: endpoint.refused == 20), endpoint.refused
    assert threading.active_count() <= threads  # no thread was taken for any of them
    for sock in extra:
        sock.settimeout(5)
        assert sock.recv(100).startswith(b"HTTP/1.0 503")
        sock.close()
    # the slots are shared by peer: a scraper elsewhere is served while this one is refused
    assert scrape_from("127.0.0.2", endpoint).startswith(b"HTTP/1.0 200")
    for sock in held:
        sock.close()


def scrape_from(source: str, server: MetricsServer) -> bytes:
    """A whole scrape from the loopback address `source` (another peer than 127.0.0.1)."""
    request = f"GET /metrics HTTP/1.0\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", server.port), 5, (source, 0)) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


@pytest.mark.parametrize("endpoint", [1.0], indirect=True)
def test_a_slow_client_is_cut_at_its_deadline_and_its_slot_comes_back(endpoint):
    """A client trickling a byte every 50 ms never lets a per-read timeout fire; the
    connection's deadline (1 s in all) cuts it anyway."""
    held = slow_client(endpoint)
    trickler = slow_client(endpoint)
    trickler.settimeout(0.05)

    def cut() -> bool:
        try:
            trickler.sendall(b"x")
            return trickler.recv(100) == b""
        except TimeoutError:
            return False
        except OSError:
            return True  # reset by the server

    assert eventually(cut, timeout_s=10)
    held.close()

    texts: list[str] = []

    def served() -> bool:
        """Whether a scrape is served: 503 until the server has seen both slots free (it
        notices `held`'s close asynchronously; a scrape right after it can still be refused,
        and so can a second one while the first one's slot is being given back)."""
        try:
            texts.append(scrape(endpoint.url, TOKEN))
            return True
        except OSError as error:
            if "HTTP 503" not in str(error):
                raise
            return False

    assert eventually(served)
    assert "python_info" not in texts[-1]  # an empty registry of its own
