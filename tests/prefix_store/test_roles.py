"""Namespace roles, token rotation and removal, and bounded per-call state: readers read,
writers store and delete only their own chunks, the owner deletes anything; rotated and
removed credentials stop working within the servers' cache time; deletes of unknown keys
leave nothing behind; an artifact over quota is refused before any of its bytes is sent.
Real shards on loopback over the session's real Redis."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from vericache.v1 import prefix_store_pb2 as pb

from prefix_store.errors import NotFound, PermissionDenied, Unauthenticated
from prefix_store.metadata.records import DEFAULT_QUOTA
from prefix_store.throttle import AuthBounds
from tests.prefix_store.conftest import LAYOUT, random_kv

TOKENS = list(range(500, 540))
CACHE_S = 0.5  # the team shard's authentication cache (prefix_store.auth.Authenticator)


@pytest.fixture
def team(store, metadata):
    """docs: owner "own", writers "w1" and "w2", reader "rd"; one shard."""
    store.start("shard-0", auth=AuthBounds(cache_s=CACHE_S))
    tokens = {name: metadata.add_tenant(name, 0) for name in ("own", "w1", "w2", "rd")}
    metadata.add_shared("docs", ["w1", "w2"], readers=["rd"], owner="own")
    return tokens


def within(seconds: float, check) -> None:
    """`check()` stops raising AssertionError within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            check()
            return
        except (AssertionError, pytest.fail.Exception):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_roles_are_recorded(metadata, team):
    assert metadata.roles("docs") == {
        "own": "owner",
        "rd": "reader",
        "w1": "writer",
        "w2": "writer",
    }
    assert metadata.tenant("rd").namespaces["docs"].role == "reader"
    assert metadata.tenant("own").namespaces[""].role == "owner"


def test_a_reader_reads_but_cannot_store_or_delete(store, team):
    kv = random_kv(LAYOUT, len(TOKENS))
    with store.client(team["w1"]) as writer:
        prefix = writer.publish_prefix(TOKENS, kv, LAYOUT, namespace="docs").prefix
    with store.client(team["rd"]) as reader:
        found = reader.lookup(TOKENS, LAYOUT, "docs")
        assert found.tokens == len(TOKENS)
        k = torch.empty(LAYOUT.num_layers, LAYOUT.num_kv_heads, found.tokens, LAYOUT.head_dim)
        v = torch.empty_like(k)
        reader.fetch_layers(found, k, v)
        assert torch.equal(k, kv[:, 0])
        with pytest.raises(PermissionDenied, match="may read it, not write it"):
            reader.publish_prefix(TOKENS, kv, LAYOUT, namespace="docs")
        with pytest.raises(PermissionDenied):
            reader.put_artifact(prefix, "snapkv:budget=0.125", b"draft")
        with pytest.raises(PermissionDenied):
            reader.delete_prefix(TOKENS, LAYOUT, "docs")
        assert reader.lookup(TOKENS, LAYOUT, "docs").tokens == len(TOKENS)


def test_writers_delete_only_their_own_chunks_and_the_owner_deletes_anything(store, team):
    with store.client(team["w1"]) as w1:
        w1.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT, namespace="docs")
    with store.client(team["w2"]) as w2:
        assert w2.delete_prefix(TOKENS, LAYOUT, "docs") == 0
        assert w2.lookup(TOKENS, LAYOUT, "docs").tokens == len(TOKENS)
    with store.client(team["own"]) as owner:
        assert owner.delete_prefix(TOKENS, LAYOUT, "docs") == LAYOUT.chunk_bytes(len(TOKENS))
        assert owner.lookup(TOKENS, LAYOUT, "docs").tokens == 0


def test_a_rotated_token_stops_working_and_the_new_one_works(store, metadata, team):
    old = team["w1"]
    with store.client(old) as client:
        client.lookup(TOKENS, LAYOUT)
        new = metadata.rotate_token("w1")

        def old_refused():
            with pytest.raises(Unauthenticated):
                client.lookup(TOKENS, LAYOUT)

        within(CACHE_S + 3, old_refused)
    with store.client(new) as client:
        assert client.lookup(TOKENS, LAYOUT, "docs").tokens == 0


def test_removed_members_and_tenants_lose_access(store, metadata, team):
    with store.client(team["w2"]) as member, store.client(team["rd"]) as reader:
        member.lookup(TOKENS, LAYOUT, "docs")
        reader.lookup(TOKENS, LAYOUT, "docs")
        metadata.remove_member("docs", "w2")
        metadata.remove_tenant("rd")

        def gone():
            with pytest.raises(NotFound, match="namespace 'docs' not found"):
                member.lookup(TOKENS, LAYOUT, "docs")
            with pytest.raises(Unauthenticated):
                reader.lookup(TOKENS, LAYOUT)

        within(CACHE_S + 3, gone)
    assert "rd" not in metadata.tenant_names()
    assert metadata.roles("docs") == {"own": "owner", "w1": "writer"}


def test_deletes_of_unknown_keys_leave_no_state(store, team):
    shard = store.servers["shard-0"].shard
    with store.client(team["w1"]) as client:
        client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT)
        claims = len(shard.holdings.claims)
        stub = client._stub(store.endpoints[0])
        keys = list(range(1, 5001))
        reply = stub.Delete(
            pb.DeleteRequest(chunk_keys=keys), metadata=client._metadata, timeout=10
        )
        assert reply.chunks == 0
        assert len(shard.holdings.claims) == claims
        assert client.lookup(TOKENS, LAYOUT).tokens == len(TOKENS)


def test_an_artifact_over_quota_is_refused_before_its_bytes_are_sent(store, metadata):
    store.start("shard-0")
    token = metadata.add_tenant("small", 1 << 20)
    ident = pb.ArtifactId(
        layout=LAYOUT.to_proto(pb), prefix_key=7, prefix_tokens=16, compressor="kivi:bits=4"
    )
    ident.size = 4 << 30  # the largest put a shard takes by default (max_put_bytes)
    release = threading.Event()

    def messages():
        yield pb.PutArtifactRequest(id=ident).SerializeToString()
        release.wait(30)  # nothing more until the answer came (or the test gave up)

    channel = grpc.insecure_channel(store.endpoints[0])
    put = channel.stream_unary(
        "/vericache.v1.PrefixStore/PutArtifact",
        request_serializer=None,
        response_deserializer=pb.PutResponse.FromString,
    )
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as failure:
        put(messages(), metadata=[("authorization", f"Bearer {token}")], timeout=20)
    release.set()
    channel.close()
    assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota" in failure.value.details()
    assert time.monotonic() - start < 10


def test_a_new_tenant_gets_a_finite_default_quota(metadata):
    metadata.add_tenant("newcomer")
    assert metadata.tenant("newcomer").quota == DEFAULT_QUOTA > 0


def test_puts_being_received_hold_only_what_arrived_and_their_quota(store, metadata):
    """A put's header holds its declared new bytes against its tenant's quota (many puts
    at once cannot overrun it) but none of the shard's receive budget: only bytes that
    arrive are held, within the tenant's fair share, and a put declaring more than that
    share is refused at once."""
    from prefix_store.client.plan import plan_chunks, put_header
    from prefix_store.config import DataPlaneLimits

    size = LAYOUT.chunk_bytes(len(TOKENS))
    server = store.start(
        "shard-0",
        receive_bytes=2 * size,
        max_put_bytes=2 * size,
        data_limits=DataPlaneLimits(ticket_ttl_s=1.0),
    )
    token = metadata.add_tenant("many", 10 * size)
    single = metadata.add_tenant("single", size)  # room for one copy of one prefix

    def open_put(client, first: int, n: int = len(TOKENS)):
        tokens = list(range(first, first + n))
        header = put_header(
            "", LAYOUT, tokens, plan_chunks(tokens, LAYOUT, client.topology.salt(""))
        )
        return client._stub(server.address).OpenPut(header, metadata=client._metadata, timeout=10)

    with store.client(token) as client:
        for first in (1000, 2000, 3000):  # declared, nothing sent: no receive budget held
            open_put(client, first)
        assert server.shard.received() == 0
        with pytest.raises(grpc.RpcError) as over_share:  # alone, a tenant may hold half
            open_put(client, 4000, 2 * len(TOKENS))
        assert over_share.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "fair share" in over_share.value.details()
        client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT)  # meanwhile
    with store.client(single) as client:
        open_put(client, 5000)
        with pytest.raises(grpc.RpcError) as over:  # each alone fits; both do not
            open_put(client, 6000)
        assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "quota" in over.value.details()
