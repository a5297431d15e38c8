"""A fetch stream refused by a shard's bounds (RESOURCE_EXHAUSTED with `retry-after-ms`:
the shard is busy, or the tenant is over its share there) moves to a replica or waits
with backoff within its retries, without quarantining the shard; when it stays refused,
the fetch fails naming the limit. Two real shards on loopback, their data-plane tickets
taken by other tenants."""

from __future__ import annotations

import pytest
import torch

from prefix_store import data_plane
from prefix_store.config import DataPlaneLimits
from prefix_store.errors import LimitExceeded, StoreError
from tests.prefix_store.conftest import LAYOUT, random_kv

TOKENS = list(range(7000, 7000 + 16 * 6))
MAX_TICKETS = 4
"""Each shard's data-plane tickets: the reader alone at a shard may hold half (two streams)."""


def empty(tokens):
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    return torch.full(shape, float("nan")), torch.full(shape, float("nan"))


def take_every_ticket(server) -> None:
    """Other tenants, one ticket each, hold every ticket of the shard's data plane (until
    they expire): the shard is busy, no tenant is over its share."""
    for n in range(MAX_TICKETS):
        server.data_plane.issue(lambda conn: None, lambda: None, tenant=f"neighbour-{n}")
    with pytest.raises(LimitExceeded, match="server busy"):
        server.data_plane.issue(lambda conn: None, lambda: None, tenant="probe")


def two_shards(store, metadata, ticket_ttl_s: float = 30.0):
    limits = DataPlaneLimits(max_tickets=MAX_TICKETS, ticket_ttl_s=ticket_ttl_s)
    servers = [store.start(f"shard-{i}", data_limits=limits) for i in range(2)]
    token = metadata.add_tenant("reader")
    kv = random_kv(LAYOUT, len(TOKENS), seed=3)
    with store.client(token) as writer:
        writer.publish_prefix(TOKENS, kv, LAYOUT)
    return servers, token, kv


def test_a_stream_refused_as_busy_moves_to_a_replica(store, metadata):
    (busy, _), token, kv = two_shards(store, metadata)
    take_every_ticket(busy)
    with store.client(token, streams=2) as reader:
        prefix = reader.lookup(TOKENS, LAYOUT)
        k, v = empty(prefix.tokens)
        reader.fetch_layers(prefix, k, v)
        assert not reader.suspects()  # busy is not down: the shard is not quarantined
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])


def test_a_stream_refused_everywhere_waits_until_room_frees(store, metadata):
    servers, token, kv = two_shards(store, metadata, ticket_ttl_s=1.0)
    for server in servers:
        take_every_ticket(server)  # they expire within about a second
    with store.client(token, retries=40, max_backoff_s=0.2) as reader:
        prefix = reader.lookup(TOKENS, LAYOUT)
        k, v = empty(prefix.tokens)
        reader.fetch_layers(prefix, k, v)
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])


def test_a_stream_refused_for_good_fails_naming_the_limit(store, metadata):
    servers, token, _ = two_shards(store, metadata)
    for server in servers:
        take_every_ticket(server)
    with store.client(token, retries=3) as reader:
        prefix = reader.lookup(TOKENS, LAYOUT)
        k, v = empty(prefix.tokens)
        with pytest.raises(StoreError, match="data-plane tickets"):
            reader.fetch_layers(prefix, k, v)


def test_a_put_refused_busy_by_the_data_plane_waits_and_lands(store, metadata, monkeypatch):
    """A tenant whose data-plane connection share at the shard is one, publishing over two
    streams: the second stream's connection is refused busy while the first one runs. The
    put waits and tries again (it is not an exceeded quota), without quarantining the
    shard, and the publish lands whole."""
    refusals = []
    refuse = data_plane.refuse
    monkeypatch.setattr(
        data_plane, "refuse", lambda conn, error: refusals.append(error) or refuse(conn, error)
    )
    store.start(data_limits=DataPlaneLimits(max_connections=2))
    tokens = list(range(9000, 9000 + 16 * 8))
    kv = random_kv(LAYOUT, len(tokens), seed=5)
    with store.client(metadata.add_tenant("writer"), streams=2, retries=6) as client:
        for attempt in range(10):  # each a new prefix; both streams race each time
            mine = [t + 1000 * attempt for t in tokens]
            client.publish_prefix(mine, kv, LAYOUT)
            prefix = client.lookup(mine, LAYOUT)
            k, v = empty(prefix.tokens)
            client.fetch_layers(prefix, k, v)
            assert torch.equal(k, kv[:, 0, :, : prefix.tokens])
            assert torch.equal(v, kv[:, 1, :, : prefix.tokens])
            if refusals:
                break
        assert refusals, "no stream was refused: the test did not test the refusal"
        assert client.suspects() == frozenset()  # busy, not down
