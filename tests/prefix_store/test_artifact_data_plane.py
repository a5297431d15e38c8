"""Artifacts over the bulk data plane (OpenPutArtifact / OpenFetchArtifact): the same bytes
and signatures as over gRPC, in both client shells; a put is two-phase across the owners,
so one owner refusing it leaves no copy anywhere; a ticket's transfer refuses bad frames.
Real shards on loopback (two, replication 2) over the session's Redis, their metrics
scraped over HTTP."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from prefix_store.blob import crc32c
from prefix_store.client.transfer import host_port, receive_artifact
from prefix_store.config import DataPlaneLimits
from prefix_store.errors import StoreError
from prefix_store.metrics import MetricsConfig, scrape
from prefix_store.protocol.frames import (
    COMMIT,
    ERROR,
    HEADER,
    OK,
    InBandError,
    read_error,
    redemption,
)
from prefix_store.provenance import Signer
from tests.prefix_store.conftest import LAYOUT, random_kv
from tests.waiting import eventually

TOKENS = list(range(700, 740))
SPEC = "snapkv:budget=0.125"
METRICS = "artifact-metrics-token"
DATA = bytes(range(256)) * 9000  # 2.3 MB: several 1 MiB pieces, and a short last one


def calls(server, method: str) -> float:
    """How many `method` calls the shard answered OK."""
    for family in text_string_to_metric_families(scrape(server.metrics_url, METRICS)):
        for s in family.samples:
            if s.name == "vericache_store_requests_total" and s.labels == {
                "code": "OK",
                "method": method,
            }:
                return s.value
    return 0.0


@pytest.fixture
def shards(store, deployment_key):
    key = deployment_key.verifier.public_bytes
    return [
        store.start(s, provenance_key=key, metrics=MetricsConfig(port=0, token=METRICS))
        for s in ("shard-0", "shard-1")
    ]


@pytest.fixture
def deployment_key():
    return Signer.generate()


@pytest.mark.parametrize("put_plane, fetch_plane", [(True, True), (False, True), (True, False)])
def test_data_plane_and_grpc_artifacts_are_the_same_bytes_and_signatures(
    store, shards, metadata, deployment_key, put_plane, fetch_plane
):
    token = metadata.add_tenant("alice")
    with store.client(token, data_plane=put_plane) as writer:
        prefix = writer.publish_prefix(TOKENS, random_kv(LAYOUT, 40), LAYOUT).prefix
        stored = writer.put_artifact(prefix, SPEC, DATA, signer=deployment_key)
    assert stored == 2 * len(DATA)  # both owners
    with store.client(token, data_plane=fetch_plane) as reader:
        assert reader.fetch_artifact(prefix, SPEC, deployment_key.verifier) == DATA
        assert reader.fetch_artifact(prefix, "h2o:budget=0.125") is None
    put_method = "OpenPutArtifact" if put_plane else "PutArtifact"
    fetch_method = "OpenFetchArtifact" if fetch_plane else "FetchArtifact"
    assert sum(calls(s, put_method) for s in shards) == 2
    assert sum(calls(s, fetch_method) for s in shards) >= 1


def test_the_async_client_moves_artifacts_over_the_data_plane(
    store, shards, metadata, deployment_key
):
    from prefix_store.client import AsyncStoreClient

    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix = client.publish_prefix(TOKENS, random_kv(LAYOUT, 40), LAYOUT).prefix

    async def round_trip():
        aio = await AsyncStoreClient.connect(store.endpoints, token)
        try:
            stored = await aio.put_artifact(prefix, SPEC, DATA, signer=deployment_key)
            return stored, await aio.fetch_artifact(prefix, SPEC, deployment_key.verifier)
        finally:
            await aio.close()

    assert asyncio.run(round_trip()) == (2 * len(DATA), DATA)
    assert sum(calls(s, "OpenPutArtifact") for s in shards) == 2
    assert sum(calls(s, "OpenFetchArtifact") for s in shards) >= 1


def test_an_owner_refusing_a_put_leaves_no_copy_on_the_other(store, metadata):
    """shard-1 has no room for the artifact: the put is refused before any byte moves, and
    shard-0, which granted its ticket, stores and charges nothing and holds no ticket."""
    roomy = store.start("shard-0", memory_bytes=64 << 20, disk_bytes=0)
    store.start("shard-1", memory_bytes=LAYOUT.chunk_bytes(40) + 4096, disk_bytes=0)
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix = client.publish_prefix(TOKENS, random_kv(LAYOUT, 40), LAYOUT).prefix
        with pytest.raises(StoreError, match="no room"):
            client.put_artifact(prefix, SPEC, DATA)
        assert client.fetch_artifact(prefix, SPEC) is None
    assert roomy.shard.counts()["artifacts"] == 0
    assert roomy.shard.usage()["alice"] == LAYOUT.chunk_bytes(40)  # the chunks alone
    assert eventually(lambda: roomy.data_plane.load() == (0, 0))


def open_put(server, token: str, prefix_key: int, size: int) -> pb.TransferTicket:
    stub = pb_grpc.PrefixStoreStub(grpc.insecure_channel(server.address))
    ident = pb.ArtifactId(
        layout=LAYOUT.to_proto(pb),
        prefix_key=prefix_key,
        prefix_tokens=40,
        compressor=SPEC,
        size=size,
    )
    return stub.OpenPutArtifact(ident, metadata=(("authorization", f"Bearer {token}"),))


def send_raw(ticket: pb.TransferTicket, token: str, frames: bytes) -> InBandError:
    """What the shard's data plane answers to `frames` after the ticket: its error frame."""
    with socket.create_connection(host_port(ticket.data_address), timeout=5) as sock:
        sock.sendall(redemption(ticket.ticket, token) + frames)
        magic, _, _, size = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
        assert magic == ERROR
        return read_error(sock, size)


@pytest.mark.parametrize(
    "frames, message",
    [
        (HEADER.pack(OK, 0, 1, 99) + b"x" * 99, "expected the artifact's 100 bytes"),
        (
            HEADER.pack(OK, 0, 1, 100) + b"x" * 100 + HEADER.pack(COMMIT, 0, 1, 4),
            "",  # the CRC itself never comes: cut by the idle timeout, below
        ),
        (
            HEADER.pack(OK, 0, 1, 100)
            + b"x" * 100
            + HEADER.pack(COMMIT, 0, 1, 4)
            + struct.pack("<I", crc32c(b"y" * 100)),
            "crc32c: the artifact arrived corrupted",
        ),
        (
            HEADER.pack(OK, 0, 1, 100) + b"x" * 100 + HEADER.pack(COMMIT, 0, 2, 8) + bytes(8),
            "expected the commit frame",
        ),
    ],
)
def test_a_malformed_artifact_transfer_is_refused_and_nothing_is_stored(
    store, metadata, frames, message
):
    server = store.start(data_limits=DataPlaneLimits(idle_s=1.0))
    token = metadata.add_tenant("alice")
    ticket = open_put(server, token, prefix_key=42, size=100)
    if message:
        code, text, _ = send_raw(ticket, token, frames)
        assert code == "INVALID_ARGUMENT" and message in text
    else:
        with socket.create_connection(host_port(ticket.data_address), timeout=5) as sock:
            sock.sendall(redemption(ticket.ticket, token) + frames)
            assert sock.recv(1) == b""  # cut when it went quiet
    assert server.shard.counts()["artifacts"] == 0
    assert server.shard.usage().get("alice", 0) == 0


def flip_stored_byte(server, blob_id) -> None:
    """Corrupt a stored artifact at rest (its stored CRC-32C stays the original's)."""
    blob = server.shard.memory.get(blob_id)
    data = bytearray(blob.data[0])
    data[5] ^= 1
    blob.data = (bytes(data),)


@pytest.mark.parametrize("corrupt", [1, 2])
def test_a_copy_corrupt_at_rest_is_never_returned_and_is_dropped(store, shards, metadata, corrupt):
    """The bytes are checked as they are sent, and by the client as they arrive: a copy
    corrupted at rest is refused and dropped by its shard; the other replica's is served,
    and with both corrupt the artifact is a miss."""
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix = client.publish_prefix(TOKENS, random_kv(LAYOUT, 40), LAYOUT).prefix
        client.put_artifact(prefix, SPEC, DATA)
        blob_id = ("artifact", "tenant:alice", prefix.key, SPEC, LAYOUT.identity())
        asked_first = client.core.artifact_owners(prefix, SPEC)[:corrupt]
        bad = [store.servers[shard_id] for shard_id in asked_first]
        for server in bad:
            flip_stored_byte(server, blob_id)
        expected = DATA if corrupt == 1 else None
        assert client.fetch_artifact(prefix, SPEC) == expected
        assert client.fetch_artifact(prefix, SPEC) == expected
    assert all(s.shard.memory.get(blob_id) is None for s in bad)
    assert sum(s.shard.stats.corrupt for s in shards) == corrupt


def open_fetch(server, token: str, prefix_key: int) -> pb.TransferTicket:
    stub = pb_grpc.PrefixStoreStub(grpc.insecure_channel(server.address))
    ident = pb.ArtifactId(
        namespace="", layout=LAYOUT.to_proto(pb), prefix_key=prefix_key, compressor=SPEC
    )
    request = pb.FetchArtifactRequest(id=ident)
    return stub.OpenFetchArtifact(request, metadata=(("authorization", f"Bearer {token}"),))


def test_a_waiting_fetch_ticket_does_not_block_a_replacement(store, metadata):
    """A fetch ticket holds no lease: a put replacing the artifact meanwhile is stored, and
    the ticket, redeemed after it, still gets the bytes it was issued for, whole and
    checked."""
    server = store.start()
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix = client.publish_prefix(TOKENS, random_kv(LAYOUT, 40), LAYOUT).prefix
        client.put_artifact(prefix, SPEC, DATA)
        ticket = open_fetch(server, token, prefix.key)
        assert ticket.total_bytes == len(DATA)
        new = DATA[::-1]
        assert client.put_artifact(prefix, SPEC, new) == len(new)
        redeem = redemption(ticket.ticket, token)
        old = receive_artifact(ticket.data_address, redeem, ticket.total_bytes, 10.0)
        assert old == DATA
        assert client.fetch_artifact(prefix, SPEC) == new


def test_fetch_tickets_pin_at_most_their_tenants_share(store, metadata):
    """Tickets not redeemed hold the artifact's bytes against their tenant's share of the
    shard's pinned bytes: past it, RESOURCE_EXHAUSTED naming the share."""
    server = store.start(memory_bytes=8 * len(DATA), disk_bytes=0)
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix = client.publish_prefix(TOKENS, random_kv(LAYOUT, 40), LAYOUT).prefix
        client.put_artifact(prefix, SPEC, DATA)
    tickets = []
    with pytest.raises(grpc.RpcError) as refused:
        for _ in range(16):
            tickets.append(open_fetch(server, token, prefix.key))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "pinned by data-plane fetch tickets" in refused.value.details()
    assert 1 <= len(tickets) < 8


def test_an_owner_stopping_during_a_put_leaves_the_artifact_on_the_others(store, metadata):
    """shard-1 is stopped while it grants its ticket, so the bytes meet a stopped shard;
    shard-0 still stores the artifact: a shard going away mid-put is UNAVAILABLE there, not
    a refusal of the put."""
    import threading

    survivor = store.start("shard-0")
    stopping = store.start("shard-1")
    token = metadata.add_tenant("alice")
    with store.client(token, retries=1) as client:
        prefix = client.publish_prefix(TOKENS, random_kv(LAYOUT, 40), LAYOUT).prefix
        outcome: list = []
        with stopping.shard.holdings.lock:  # shard-1's OpenPutArtifact waits inside it
            putting = threading.Thread(
                target=lambda: outcome.append(client.put_artifact(prefix, SPEC, DATA))
            )
            putting.start()
            time.sleep(1.0)
            threading.Thread(target=store.stop, args=("shard-1", 0)).start()
            time.sleep(0.5)
        putting.join(30)
        assert outcome == [len(DATA)]
        assert survivor.shard.counts()["artifacts"] == 1
        assert client.fetch_artifact(prefix, SPEC) == DATA
