"""Near-data attention (`Attend`) end to end over loopback, with real Redis and real
shards: partials computed by the shards are bitwise what the kernel computes locally on the
published KV; tenants, malformed streams, kernel mismatches, a shard lost mid-session,
corruption in transit, the per-tenant stream limit, quiet streams and the disk tier."""

from __future__ import annotations

import dataclasses
import threading

import grpc
import pytest
import torch
from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from numerics.cpu import partials as attention
from prefix_store.errors import KernelMismatch, LimitExceeded, NotFound, Unavailable
from prefix_store.faults import ATTEND
from prefix_store.layout import KVLayout
from prefix_store.limits import CallBounds
from prefix_store.server import attend as attend_server
from tests.prefix_store.conftest import random_kv
from tests.waiting import eventually

LAYOUT = KVLayout(
    "attend-model@1", "float32", num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=16
)
HEADS = 4  # GQA: two query heads per KV head
KERNEL = attention.kernel_fingerprint()

pytestmark = pytest.mark.fused_kernel  # skips only where the CPU cannot run it


def tokens_of(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def rows(n: int, seed: int) -> torch.Tensor:
    """Query rows [n, HEADS, head_dim], float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HEADS, LAYOUT.head_dim, generator=g)


def local(kv: torch.Tensor, chunks: int, layer: int, q: torch.Tensor) -> attention.Partials:
    """The kernel's partials over the first `chunks` full chunks of the published KV."""
    size = LAYOUT.chunk_tokens
    keys = [kv[layer, 0, :, c * size : (c + 1) * size].contiguous() for c in range(chunks)]
    values = [kv[layer, 1, :, c * size : (c + 1) * size].contiguous() for c in range(chunks)]
    return attention.chunk_partials(q, keys, values)


def assert_bitwise(got: attention.Partials, want: attention.Partials) -> None:
    for name in ("m", "l", "acc"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape, name
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name


def publish(client, n: int, seed: int = 0, base: int = 1000):
    """Publish n tokens of random KV; returns (the looked-up prefix, the KV)."""
    kv = random_kv(LAYOUT, n, seed=seed)
    client.publish_prefix(tokens_of(n, base), kv, LAYOUT)
    prefix = client.lookup(tokens_of(n, base), LAYOUT)
    assert prefix.tokens == n
    return prefix, kv


def auth(token: str):
    return (("authorization", f"Bearer {token}"),)


def header(prefix, kernel: str = KERNEL, heads: int = HEADS, namespace: str = ""):
    chunks = [
        pb.ChunkRef(key=c.key, tokens=c.tokens, digest=c.proof.digest)
        for c in prefix.chunks
        if c.tokens == LAYOUT.chunk_tokens
    ]
    return pb.AttendHeader(
        namespace=namespace,
        layout=LAYOUT.to_proto(pb),
        chunks=chunks,
        kernel=kernel,
        heads=heads,
    )


def query(layer: int, q: torch.Tensor) -> pb.AttendRequest:
    data = q.contiguous().numpy().tobytes()
    return pb.AttendRequest(query=pb.AttendQuery(layer=layer, rows=q.shape[0], q=data))


def raw_attend(address: str, token: str, messages: list) -> list[pb.AttendResponse]:
    """Attend with plain gRPC: every message sent, every response read."""
    with grpc.insecure_channel(address) as channel:
        call = pb_grpc.PrefixStoreStub(channel).Attend(iter(messages), metadata=auth(token))
        return list(call)


def status_of(address: str, token: str, messages: list) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        raw_attend(address, token, messages)
    return error.value.code(), error.value.details()


@pytest.mark.parametrize("n", [16, 16 * 5, 16 * 6 + 7], ids=["one-chunk", "five", "mid-chunk"])
def test_shard_partials_are_bitwise_the_local_kernel(store, metadata, n):
    for shard in ("shard-0", "shard-1", "shard-2"):
        store.start(shard)
    metadata.set_replication(2)
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix, kv = publish(client, n, seed=n)
        full = n // LAYOUT.chunk_tokens
        with client.open_attention(prefix, HEADS, KERNEL) as session:
            assert len(session.chunks) == full and session.tokens == full * LAYOUT.chunk_tokens
            assert session.kernels_match()
            for layer, count in [(0, 1), (1, 5), (0, 3), (1, 1)]:
                q = rows(count, seed=layer * 10 + count)
                assert_bitwise(session.query(layer, q), local(kv, full, layer, q))
            assert session.bytes_sent > 0 and session.bytes_received > 0
            assert session.wire_s > 0 and 0 < session.shard_s <= session.wire_s
    answered = sum(s.servicer.attend_stats.queries for s in store.servers.values())
    assert answered >= 4  # one per owner shard and query


def test_shards_advertise_their_kernel_and_count_what_they_served(store, metadata):
    store.start("shard-0")
    store.start("shard-1", attention=False)
    token = metadata.add_tenant("alice")
    with grpc.insecure_channel(store.endpoints[0]) as channel:
        described = pb_grpc.PrefixStoreStub(channel).Describe(
            pb.DescribeRequest(), metadata=auth(token)
        )
    assert {s.shard_id: s.attention_kernel for s in described.shards} == {
        "shard-0": KERNEL,
        "shard-1": "",
    }
    with store.client(token) as client:
        prefix, kv = publish(client, 16 * 4)
        with client.open_attention(prefix, HEADS, KERNEL) as session:
            # shard-1 holds a copy of every chunk but cannot serve Attend: shard-0 serves all.
            assert not session.kernels_match()
            q = rows(3, seed=1)
            assert_bitwise(session.query(1, q), local(kv, 4, 1, q))
    stats = store.servers["shard-0"].servicer.shard_stats()
    assert stats["attend_streams"] == 1 and stats["attend_queries"] == 1
    assert stats["attend_rows"] == 3
    assert stats["attend_bytes_in"] == 3 * HEADS * LAYOUT.head_dim * 4
    assert stats["attend_bytes_out"] == 4 * 3 * HEADS * (LAYOUT.head_dim + 2) * 4
    assert store.servers["shard-1"].servicer.shard_stats()["attend_queries"] == 0


def test_another_tenants_prefix_is_not_found(store, metadata):
    store.start("shard-0")
    alice, bob = metadata.add_tenant("alice"), metadata.add_tenant("bob")
    with store.client(alice) as client:
        prefix, _ = publish(client, 16 * 2)
    with store.client(bob) as client:
        session = client.open_attention(prefix, HEADS, KERNEL)
        with session, pytest.raises(NotFound):
            session.query(0, rows(1, seed=0))
    code, _ = status_of(store.endpoints[0], bob, [pb.AttendRequest(header=header(prefix))])
    assert code == grpc.StatusCode.NOT_FOUND


def _layout(**change) -> pb.KVLayout:
    return dataclasses.replace(LAYOUT, **change).to_proto(pb)


HEADER_CASES = [
    (lambda h: h.layout.CopyFrom(_layout(dtype="float16")), "header.layout.dtype"),
    (lambda h: h.layout.CopyFrom(_layout(head_dim=12)), "header.layout.head_dim"),
    (lambda h: h.layout.CopyFrom(_layout(chunk_tokens=12)), "header.layout.chunk_tokens"),
    (lambda h: setattr(h, "heads", 3), "header.heads"),
    (lambda h: setattr(h, "heads", 0), "header.heads"),
    (lambda h: setattr(h, "heads", 2048), "header.heads"),
    (lambda h: h.ClearField("chunks"), "header.chunks"),
    (lambda h: setattr(h.chunks[0], "tokens", 7), "header.chunks[0].tokens"),
    (lambda h: h.ClearField("layout"), "layout: required"),
]


@pytest.mark.parametrize("mutate, field", HEADER_CASES)
def test_malformed_headers_are_invalid_argument(store, metadata, mutate, field):
    store.start("shard-0")
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix, _ = publish(client, 16 * 2)
    bad = header(prefix)
    mutate(bad)
    code, details = status_of(store.endpoints[0], token, [pb.AttendRequest(header=bad)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, details


def test_malformed_queries_and_orders_are_invalid_argument(store, metadata):
    store.start("shard-0")
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix, _ = publish(client, 16 * 2)
    first = pb.AttendRequest(header=header(prefix))
    good = query(0, rows(2, seed=0))
    short_q = query(0, rows(2, seed=0))
    short_q.query.rows = 3
    cases = [
        ([good], "the first message must be the header"),
        ([first, first], "only queries may come"),
        ([first, query(2, rows(1, seed=0))], "query.layer: 2"),
        ([first, pb.AttendRequest(query=pb.AttendQuery(layer=0, rows=0))], "query.rows: 0"),
        ([first, pb.AttendRequest(query=pb.AttendQuery(layer=0, rows=4097))], "query.rows: 4097"),
        ([first, short_q], "query.q: 512 bytes; expected 768"),
    ]
    for messages, field in cases:
        code, details = status_of(store.endpoints[0], token, messages)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, (field, details)
    # A well-formed stream after all that: one answer per query, in order.
    answers = raw_attend(store.endpoints[0], token, [first, good, query(1, rows(1, seed=1))])
    assert [a.layer for a in answers] == [0, 1]


def test_a_wrong_kernel_is_a_mismatch_the_caller_can_fall_back_on(store, metadata):
    store.start("shard-0")
    store.start("shard-1", attention=False)
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix, _ = publish(client, 16 * 2)
        with client.open_attention(prefix, HEADS, "f" * 24) as session:
            assert not session.kernels_match()
            with pytest.raises(KernelMismatch, match="no live owner"):
                session.query(0, rows(1, seed=0))
    wrong = header(prefix, kernel="0123456789abcdef0123")
    code, details = status_of(store.endpoints[0], token, [pb.AttendRequest(header=wrong)])
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'0123456789abcdef'" in details and repr(KERNEL[:16]) in details, details
    # A shard without a kernel refuses whatever the caller says.
    code, details = status_of(store.endpoints[1], token, [pb.AttendRequest(header=header(prefix))])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no fused attention kernel" in details


def test_a_shard_stopped_mid_session_fails_over_to_its_replica_bitwise(store, metadata):
    for shard in ("shard-0", "shard-1", "shard-2"):
        store.start(shard)
    metadata.set_replication(2)
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix, kv = publish(client, 16 * 6 + 3, seed=3)
        with client.open_attention(prefix, HEADS, KERNEL) as session:
            q = rows(4, seed=5)
            assert_bitwise(session.query(0, q), local(kv, 6, 0, q))
            victim = client.topology.owners(session.chunks[0].parent)[0]
            store.stop(victim, grace_s=0)
            for layer in (1, 0):
                assert_bitwise(session.query(layer, q), local(kv, 6, layer, q))
            assert victim in client.suspects()


def test_a_shard_that_hangs_mid_session_is_left_for_its_replica_after_the_idle_deadline(
    store, metadata, monkeypatch
):
    """A hung shard (a stopped host: no answer, no error) is lost after the client's idle
    deadline, as a silent data-plane socket is, not after the unary call deadline (30 s by
    default, for which a decoder's whole forward would wait): the query is answered by the
    replica, bitwise, while the hung shard still holds it."""
    for shard in ("shard-0", "shard-1", "shard-2"):
        store.start(shard)
    metadata.set_replication(2)
    token = metadata.add_tenant("alice")
    victim, release = [], threading.Event()
    hanging, hung_out = threading.Event(), threading.Event()
    opened = attend_server.open_session

    def open_hanging(shard, *args):
        session = opened(shard, *args)
        answer = session.answer

        def answer_or_hang(query):
            if query.layer == 1 and victim == [shard.config.shard_id]:
                hanging.set()
                release.wait(60)
                hung_out.set()
            return answer(query)

        session.answer = answer_or_hang
        return session

    monkeypatch.setattr(attend_server, "open_session", open_hanging)
    try:
        with store.client(token, timeout_s=120.0, idle_timeout_s=0.5) as client:
            prefix, kv = publish(client, 16 * 6 + 3, seed=3)
            with client.open_attention(prefix, HEADS, KERNEL) as session:
                q = rows(4, seed=5)
                assert_bitwise(session.query(0, q), local(kv, 6, 0, q))
                victim.append(client.topology.owners(session.chunks[0].parent)[0])
                assert_bitwise(session.query(1, q), local(kv, 6, 1, q))
                assert hanging.is_set() and not hung_out.is_set()  # answered while it hangs
                assert victim[0] in client.suspects()
    finally:
        release.set()


def test_with_no_replica_left_a_query_fails_unavailable_or_not_found(store, metadata):
    store.start("shard-0")
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix, _ = publish(client, 16 * 2)
        with client.open_attention(prefix, HEADS, KERNEL) as session:
            session.query(0, rows(1, seed=0))
            store.stop("shard-0", grace_s=0)
            with pytest.raises((Unavailable, NotFound)):
                session.query(1, rows(1, seed=0))


def test_partials_corrupted_in_transit_are_read_from_a_replica(store, metadata):
    store.start("shard-0")
    store.start("shard-1")
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix, kv = publish(client, 16 * 3, seed=7)
        with client.open_attention(prefix, HEADS, KERNEL) as session:
            fired = ATTEND.fired
            ATTEND.arm(1)
            try:
                q = rows(2, seed=9)
                assert_bitwise(session.query(1, q), local(kv, 3, 1, q))
            finally:
                ATTEND.disarm()
            assert ATTEND.fired == fired + 1


def test_attend_streams_per_tenant_are_bounded(store, metadata):
    server = store.start("shard-0", max_attend_streams_per_tenant=1)
    alice, bob = metadata.add_tenant("alice"), metadata.add_tenant("bob")
    with store.client(alice) as client:
        prefix, kv = publish(client, 16 * 2)
        first = client.open_attention(prefix, HEADS, KERNEL)
        first.query(0, rows(1, seed=0))  # holds the tenant's one stream
        second = client.open_attention(prefix, HEADS, KERNEL)
        with pytest.raises(LimitExceeded, match="per-tenant limit 1"):
            second.query(0, rows(1, seed=0))
        code, details = status_of(
            store.endpoints[0], alice, [pb.AttendRequest(header=header(prefix))]
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Attend streams" in details
        with store.client(bob) as other:  # other tenants are unaffected by alice's limit
            bob_prefix, bob_kv = publish(other, 16)
            with other.open_attention(bob_prefix, HEADS, KERNEL) as session:
                q = rows(1, seed=2)
                assert_bitwise(session.query(0, q), local(bob_kv, 1, 0, q))
        first.close()
        # the shard frees the Attend slot once it sees the stream end, before the call slot
        # the stream held (`rpc.handler.streaming`): no alice call in flight, no slot held
        assert eventually(lambda: server.servicer.limits.in_flight("alice") == 0, timeout_s=5)
        q = rows(2, seed=3)
        assert_bitwise(second.query(1, q), local(kv, 2, 1, q))
        second.close()


def test_a_quiet_stream_cut_by_the_shard_is_reopened_on_the_same_shard(store, metadata):
    server = store.start("shard-0", calls=CallBounds(stream_idle_s=0.3))
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix, kv = publish(client, 16 * 2)
        with client.open_attention(prefix, HEADS, KERNEL) as session:
            q = rows(2, seed=4)
            assert_bitwise(session.query(0, q), local(kv, 2, 0, q))
            # the shard cancels the quiet stream: its call slot comes back
            assert eventually(lambda: server.servicer.limits.in_flight() == 0, timeout_s=5)
            assert_bitwise(session.query(1, q), local(kv, 2, 1, q))
            assert client.suspects() == frozenset()
    assert store.servers["shard-0"].servicer.attend_stats.streams == 2


def test_chunks_on_the_disk_tier_are_served(store, metadata):
    store.start("shard-0", memory_bytes=0, disk_bytes=1 << 24)
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix, kv = publish(client, 16 * 3 + 5, seed=8)
        shard = store.servers["shard-0"].shard
        assert shard.memory.used == 0 and shard.disk.used > 0
        with client.open_attention(prefix, HEADS, KERNEL) as session:
            q = rows(3, seed=6)
            for layer in (0, 1):
                assert_bitwise(session.query(layer, q), local(kv, 3, layer, q))


def test_a_chunk_corrupt_at_rest_is_data_loss_and_read_from_a_replica(store, metadata):
    store.start("shard-0")
    store.start("shard-1")
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix, kv = publish(client, 16 * 2, seed=12)
        shard = store.servers[client.topology.owners(prefix.chunks[1].parent)[0]].shard
        blob = next(shard.memory.get(i) for i in shard.memory.ids() if i[2] == prefix.chunks[1].key)
        flipped = bytes([blob.data[1][0] ^ 0xFF]) + bytes(blob.data[1][1:])
        blob.data = (blob.data[0], flipped, *blob.data[2:])  # layer 1 of chunk 1
        with client.open_attention(prefix, HEADS, KERNEL) as session:
            q = rows(2, seed=13)
            assert_bitwise(session.query(1, q), local(kv, 2, 1, q))
        assert shard.stats.corrupt == 1


def test_a_shard_that_changed_its_kernel_since_describe_is_a_mismatch(store, metadata):
    server = store.start("shard-0")
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix, _ = publish(client, 16)
        session = client.open_attention(prefix, HEADS, KERNEL)
        assert session.kernels_match()
        server.servicer.kernel = "another-kernel-build"  # the client's Describe is older
        with (
            session,
            pytest.raises(KernelMismatch, match="is not this shard's kernel 'another-kernel-b'"),
        ):
            session.query(0, rows(1, seed=0))
