"""The PrefixStore gRPC service end to end over loopback, with real Redis: round trips,
two-phase puts under interrupted clients, status codes, auth and tenant isolation,
quotas, health checking and reflection, a Redis restart."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from prefix_store.errors import NotFound, QuotaExceeded
from tests.prefix_store.conftest import LAYOUT, random_kv
from tests.waiting import eventually

TOKENS = list(range(500, 540))  # 16 + 16 + 8 tokens


def stub(store):
    return pb_grpc.PrefixStoreStub(grpc.insecure_channel(store.endpoints[0]))


def auth(token):
    return (("authorization", f"Bearer {token}"),)


def fetch_into(client, prefix):
    k = torch.empty(LAYOUT.num_layers, LAYOUT.num_kv_heads, prefix.tokens, LAYOUT.head_dim)
    v = torch.empty_like(k)
    client.fetch_layers(prefix, k, v)
    return k, v


def test_publish_lookup_fetch_round_trip_is_bitwise(store, metadata):
    store.start()
    token = metadata.add_tenant("alice")
    kv = random_kv(LAYOUT, len(TOKENS))
    with store.client(token) as client:
        published = client.publish_prefix(TOKENS, kv, LAYOUT)
        assert published.stored_bytes == LAYOUT.chunk_bytes(40)
        prefix = client.lookup(TOKENS + [1, 2, 3], LAYOUT)
        assert prefix.tokens == 40 and prefix.key == published.prefix.key
        k, v = fetch_into(client, prefix)
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])


def test_an_interrupted_put_leaves_nothing(store, metadata):
    store.start()
    token = metadata.add_tenant("alice")
    kv = random_kv(LAYOUT, len(TOKENS))
    with store.client(token) as client:
        from prefix_store.client.plan import as_layers, plan_chunks, put_messages

        chunks = plan_chunks(TOKENS, LAYOUT, client.topology.salt(""))
        messages = list(put_messages("", LAYOUT, TOKENS, chunks, as_layers(kv, LAYOUT, 40), 4096))
        put = client._bulk_put(store.endpoints[0], 0)
        # The client goes away after half of the segments: no commit ever arrives.
        future = put.future(iter(messages[: len(messages) // 2]), metadata=auth(token))
        with pytest.raises(grpc.RpcError) as error:
            future.result(timeout=10)
        assert error.value.code() == grpc.StatusCode.ABORTED
        # Cancelled mid-stream by the client: also nothing.
        slow = iter(messages[:3] + [None])

        def stalled():
            for m in slow:
                if m is None:
                    time.sleep(5)
                    return
                yield m

        future = put.future(stalled(), metadata=auth(token))
        time.sleep(0.3)
        future.cancel()
        time.sleep(0.3)
        assert client.lookup(TOKENS, LAYOUT).tokens == 0
        assert sum(s.chunks for s in client.stats()) == 0
        assert metadata.usage().get("alice", 0) == 0


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda h: h.layout.ClearField("dtype"), "layout.dtype"),
        (lambda h: setattr(h.layout, "dtype", "int8"), "layout.dtype"),
        (lambda h: setattr(h.layout, "num_layers", 0), "layout.num_layers"),
        (lambda h: h.ClearField("layout"), "layout: required"),
        (lambda h: h.chunk_indices.append(9), "chunk_indices"),
        (lambda h: h.ClearField("chunk_indices"), "chunk_indices"),
    ],
)
def test_malformed_put_headers_are_invalid_argument(store, metadata, mutate, field):
    store.start()
    token = metadata.add_tenant("alice")
    header = pb.PutHeader(layout=LAYOUT.to_proto(pb), token_ids=TOKENS, chunk_indices=[0])
    mutate(header)
    with pytest.raises(grpc.RpcError) as error:
        stub(store).Put(iter([pb.PutRequest(header=header)]), metadata=auth(token))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details()


def test_malformed_segments_and_orders_are_invalid_argument(store, metadata):
    store.start()
    token = metadata.add_tenant("alice")
    header = pb.PutRequest(
        header=pb.PutHeader(layout=LAYOUT.to_proto(pb), token_ids=TOKENS[:16], chunk_indices=[0])
    )
    bad_size = pb.PutRequest(
        segments=pb.SegmentBatch(segments=[pb.Segment(layer=0, chunk=0, data=b"x" * 7)])
    )
    cases = [
        ([bad_size], "put: the first message must be a header"),
        ([header, bad_size], "segment.data"),
        ([header, header], "unexpected header"),
        ([header, pb.PutRequest(commit=pb.PutCommit(crc32c=[1]))], "segments are missing"),
    ]
    garbage = b"\x0a\x03\xff\xff\xff"  # a PutRequest whose header field is not a PutHeader
    with pytest.raises(grpc.RpcError) as error:
        store_client = store.client(token)
        store_client._bulk_put(store.endpoints[0], 0)(iter([garbage]), metadata=auth(token))
    store_client.close()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "PutHeader: malformed" in error.value.details()
    for messages, message in cases:
        with pytest.raises(grpc.RpcError) as error:
            stub(store).Put(iter(messages), metadata=auth(token))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert message in error.value.details()
    fetch = pb.FetchRequest(layout=LAYOUT.to_proto(pb), chunks=[pb.ChunkRef(key=1, tokens=16)])
    for request, code, message in [
        (pb.FetchRequest(layout=LAYOUT.to_proto(pb)), "INVALID_ARGUMENT", "chunks"),
        (fetch, "NOT_FOUND", "chunks[0]"),
        (
            pb.FetchRequest(layout=LAYOUT.to_proto(pb), chunks=fetch.chunks, layer_end=99),
            "INVALID_ARGUMENT",
            "layer range",
        ),
        (
            pb.FetchRequest(
                layout=LAYOUT.to_proto(pb), chunks=fetch.chunks, max_message_bytes=1 << 30
            ),
            "INVALID_ARGUMENT",
            "max_message_bytes",
        ),
    ]:
        with pytest.raises(grpc.RpcError) as error:
            list(stub(store).Fetch(request, metadata=auth(token)))
        assert error.value.code().name == code and message in error.value.details()
    lookup = pb.LookupRequest(layout=LAYOUT.to_proto(pb), token_ids=[1], chunk_indices=[5])
    with pytest.raises(grpc.RpcError) as error:
        stub(store).Lookup(lookup, metadata=auth(token))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_oversized_messages_are_rejected_and_the_server_keeps_serving(store, metadata):
    store.start(max_message_bytes=1 << 20, message_bytes=1 << 20)
    token = metadata.add_tenant("alice")
    huge = pb.PutRequest(
        header=pb.PutHeader(layout=LAYOUT.to_proto(pb), token_ids=[1 << 20] * 400_000)
    )
    with pytest.raises(grpc.RpcError) as error:
        stub(store).Put(iter([huge]), metadata=auth(token))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the limit of 1048576 bytes" in error.value.details()
    lookup = pb.LookupRequest(layout=LAYOUT.to_proto(pb), token_ids=[1 << 20] * 400_000)
    with pytest.raises(grpc.RpcError) as error:
        stub(store).Lookup(lookup, metadata=auth(token))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "LookupRequest" in error.value.details()
    assert stub(store).Describe(pb.DescribeRequest(), metadata=auth(token)).tenant == "alice"


def test_authentication_is_required(store, metadata):
    store.start()
    metadata.add_tenant("alice")
    for md, message in [
        ((), "missing bearer token"),
        ((("authorization", "Basic abc"),), "Bearer"),
        (auth("vc_not-a-token"), "unknown token"),
    ]:
        with pytest.raises(grpc.RpcError) as error:
            stub(store).Describe(pb.DescribeRequest(), metadata=md)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert message in error.value.details()


def test_tenants_are_isolated_and_shared_namespaces_are_for_members(store, metadata):
    store.start()
    alice, bob, carol = (metadata.add_tenant(n) for n in ("alice", "bob", "carol"))
    metadata.add_shared("docs", ["alice", "bob"])
    kv = random_kv(LAYOUT, len(TOKENS))
    with store.client(alice) as a, store.client(bob) as b, store.client(carol) as c:
        private = a.publish_prefix(TOKENS, kv, LAYOUT).prefix
        a.publish_prefix(TOKENS, kv, LAYOUT, namespace="docs")
        # Bob: Alice's private prefix looks absent; a fetch by its keys is NOT_FOUND.
        assert b.lookup(TOKENS, LAYOUT).tokens == 0
        with pytest.raises(NotFound):
            fetch_into(b, private)
        # The shared one works for Bob, a member, and is the same bytes.
        shared = b.lookup(TOKENS, LAYOUT, namespace="docs")
        assert shared.tokens == 40
        assert torch.equal(fetch_into(b, shared)[0], kv[:, 0])
        # Stats show a tenant its own data only.
        assert sum(s.chunks for s in a.stats()) == 6 and sum(s.chunks for s in b.stats()) == 0
        assert all(s.lookup_hits == 0 and s.memory_bytes == 0 for s in b.stats())
        # Carol is no member: the namespace does not exist for her.
        with pytest.raises(NotFound, match="namespace 'docs' not found"):
            c.lookup(TOKENS, LAYOUT, namespace="docs")
    request = pb.LookupRequest(namespace="docs", layout=LAYOUT.to_proto(pb), token_ids=TOKENS)
    with pytest.raises(grpc.RpcError) as error:
        stub(store).Lookup(request, metadata=auth(carol))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_quota_exhaustion_is_resource_exhausted_with_usage_and_stores_nothing(store, metadata):
    store.start()
    chunk = LAYOUT.chunk_bytes(16)
    token = metadata.add_tenant("alice", quota=3 * chunk)
    with store.client(token) as client:
        client.publish_prefix(TOKENS[:32], random_kv(LAYOUT, 32), LAYOUT)
        other = list(range(900, 932))
        with pytest.raises(QuotaExceeded, match=rf"\d+ bytes stored .* quota of {3 * chunk}"):
            client.publish_prefix(other, random_kv(LAYOUT, 32), LAYOUT)
        assert client.lookup(other, LAYOUT).tokens == 0
        assert sum(s.tenant_bytes for s in client.stats()) == 2 * chunk


def test_artifacts_round_trip_and_a_missing_one_is_none(store, metadata):
    store.start()
    token = metadata.add_tenant("alice")
    blob = bytes(range(256)) * 5000
    with store.client(token, message_bytes=256 * 1024) as client:
        prefix = client.publish_prefix(TOKENS, random_kv(LAYOUT, 40), LAYOUT).prefix
        client.put_artifact(prefix, "snapkv:budget=0.125", blob)
        assert client.fetch_artifact(prefix, "snapkv:budget=0.125") == blob
        assert client.fetch_artifact(prefix, "h2o:budget=0.125") is None
        assert client.delete_prefix(TOKENS, LAYOUT) == LAYOUT.chunk_bytes(40) + len(blob)
        assert client.fetch_artifact(prefix, "snapkv:budget=0.125") is None


def test_health_checking_and_reflection(store, metadata):
    store.start()
    channel = grpc.insecure_channel(store.endpoints[0])
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "vericache.v1.PrefixStore"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    answer = next(reflection.ServerReflectionInfo(iter([request])))
    names = {s.name for s in answer.list_services_response.service}
    assert {"vericache.v1.PrefixStore", "grpc.health.v1.Health"} <= names


def test_redis_restart_shards_reregister_and_nothing_stored_is_lost(store, metadata, redis_server):
    store.start("shard-0")
    store.start("shard-1")
    token = metadata.add_tenant("alice")
    kv = random_kv(LAYOUT, 40)
    with store.client(token) as client:
        client.publish_prefix(TOKENS, kv, LAYOUT)
        redis_server.restart()  # tenants persist (append-only file) ...
        soft = metadata.redis.keys("vc:shard:*") + metadata.redis.keys("vc:usage:*")
        metadata.redis.delete(*soft)  # ... and soft state lost with Redis is re-sent
        want_usage = 2 * LAYOUT.chunk_bytes(40)

        def reregistered() -> bool:  # each shard re-sends on its own heartbeat
            shards = {s.shard_id for s in metadata.shards()}
            return shards == {"shard-0", "shard-1"} and metadata.usage().get("alice") == want_usage

        eventually(reregistered, timeout_s=10, every_s=0.1)
        assert {s.shard_id for s in metadata.shards()} == {"shard-0", "shard-1"}
        assert metadata.usage()["alice"] == want_usage
        client.describe()
        prefix = client.lookup(TOKENS, LAYOUT)
        assert prefix.tokens == 40
        assert torch.equal(fetch_into(client, prefix)[1], kv[:, 1])
