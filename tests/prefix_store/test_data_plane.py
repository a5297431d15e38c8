"""The bulk data plane beside gRPC: tickets, in-band errors, leases, and equality with the
plain gRPC path for the same requests."""

from __future__ import annotations

import socket

import grpc
import pytest
import torch
from vericache.v1 import prefix_store_pb2 as pb
from vericache.v1 import prefix_store_pb2_grpc as pb_grpc

from prefix_store.client.transfer import host_port
from prefix_store.errors import NotFound
from prefix_store.protocol.frames import ERROR, HEADER, read_error, redemption
from tests.prefix_store.conftest import LAYOUT, random_kv
from tests.waiting import eventually

TOKENS = list(range(3000, 3000 + 16 * 6 + 9))


def empty(tokens):
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    return torch.full(shape, float("nan")), torch.full(shape, float("nan"))


@pytest.mark.parametrize("put_plane, fetch_plane", [(True, True), (False, True), (True, False)])
def test_data_plane_and_grpc_paths_store_and_return_the_same_bytes(
    store, metadata, put_plane, fetch_plane
):
    store.start("shard-0")
    store.start("shard-1")
    token = metadata.add_tenant("alice")
    kv = random_kv(LAYOUT, len(TOKENS), seed=9)
    with store.client(token, data_plane=put_plane) as writer:
        assert writer.topology.data_addresses.keys() == {"shard-0", "shard-1"}
        writer.publish_prefix(TOKENS, kv, LAYOUT)
    with store.client(token, data_plane=fetch_plane, streams=4) as reader:
        prefix = reader.lookup(TOKENS, LAYOUT)
        k, v = empty(prefix.tokens)
        reader.fetch_layers(prefix, k, v)
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])


def test_non_contiguous_outputs_fall_back_to_grpc_and_still_match(store, metadata):
    store.start()
    token = metadata.add_tenant("alice")
    kv = random_kv(LAYOUT, len(TOKENS), seed=10)
    with store.client(token) as client:
        prefix = client.publish_prefix(TOKENS, kv, LAYOUT).prefix
        k = torch.empty(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, prefix.tokens)
        v = torch.empty_like(k)
        client.fetch_layers(prefix, k.transpose(2, 3), v.transpose(2, 3))
    assert torch.equal(k.transpose(2, 3), kv[:, 0]) and torch.equal(v.transpose(2, 3), kv[:, 1])


def test_an_unknown_ticket_gets_an_in_band_error(store, metadata):
    server = store.start()
    with socket.create_connection(host_port(server.data_address), timeout=5) as sock:
        sock.sendall(b"\x00" * 48)
        header = sock.recv(HEADER.size, socket.MSG_WAITALL)
        magic, _, _, size = HEADER.unpack(header)
        assert magic == ERROR
        assert read_error(sock, size) == ("UNAVAILABLE", "unknown or expired ticket", None)


def test_a_ticket_holds_a_lease_until_it_expires_unused(store, metadata):
    server = store.start()
    server.data_plane.ticket_ttl_s = 0.2
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        prefix = client.publish_prefix(TOKENS, random_kv(LAYOUT, len(TOKENS)), LAYOUT).prefix
        request = pb.FetchRequest(
            layout=LAYOUT.to_proto(pb),
            chunks=[pb.ChunkRef(key=c.key, tokens=c.tokens) for c in prefix.chunks],
        )
        stub = pb_grpc.PrefixStoreStub(grpc.insecure_channel(server.address))
        md = (("authorization", f"Bearer {token}"),)
        ticket = stub.OpenFetch(request, metadata=md)
        assert ticket.total_bytes == LAYOUT.chunk_bytes(len(TOKENS))
        assert server.shard.counts()["leased"] == len(prefix.chunks)
        # the reaper expires it although no other ticket is issued
        assert eventually(lambda: server.shard.counts()["leased"] == 0, timeout_s=5)
        with socket.create_connection(host_port(ticket.data_address), timeout=5) as sock:
            sock.sendall(redemption(ticket.ticket, token))  # expired: no longer works
            magic, *_ = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
            assert magic == ERROR


def test_a_corrupt_chunk_over_the_data_plane_is_a_miss_after_every_replica(store, metadata):
    server = store.start()
    token = metadata.add_tenant("alice")
    kv = random_kv(LAYOUT, len(TOKENS))
    with store.client(token) as client:
        prefix = client.publish_prefix(TOKENS, kv, LAYOUT).prefix
        blob = server.shard.memory.get(("chunk", "tenant:alice", prefix.chunks[2].key))
        flipped = bytes([blob.data[1][0] ^ 1]) + bytes(blob.data[1][1:])
        blob.data = (blob.data[0], flipped, *blob.data[2:])
        k, v = empty(prefix.tokens)
        with pytest.raises(NotFound, match="checksum"):
            client.fetch_layers(prefix, k, v)
        assert client.lookup(TOKENS, LAYOUT).tokens == 32  # chunk 2 is gone, 0 and 1 remain
