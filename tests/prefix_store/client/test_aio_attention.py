"""Near-data attention through `AsyncStoreClient`: the threaded session's scenarios
(tests/prefix_store/test_attend.py) on grpc.aio, against real shards on loopback: partials
bitwise the local kernel, a shard lost mid-session, no replica left, corruption in transit
and a quiet stream cut by the shard."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from prefix_store.client import AsyncStoreClient
from prefix_store.config import ClientConfig
from prefix_store.errors import InvalidArgument, NotFound, Unavailable
from prefix_store.faults import ATTEND
from prefix_store.limits import CallBounds
from tests.prefix_store.test_attend import HEADS, KERNEL, LAYOUT, assert_bitwise, local, publish
from tests.prefix_store.test_attend import rows as query_rows
from tests.waiting import eventually

pytestmark = pytest.mark.fused_kernel


def published(store, token: str, n: int, seed: int):
    with store.client(token) as client:
        return publish(client, n, seed=seed)


async def connected(store, token: str) -> AsyncStoreClient:
    config = ClientConfig(timeout_s=10.0, stream_timeout_s=30.0, retries=2)
    return await AsyncStoreClient.connect(store.endpoints, token, config)


@contextlib.asynccontextmanager
async def attending(store, token: str, prefix):
    """(an async client, its session over `prefix`), both closed at the end."""
    async with (
        await connected(store, token) as client,
        await client.open_attention(prefix, HEADS, KERNEL) as session,
    ):
        yield client, session


@pytest.mark.parametrize("n", [16, 16 * 6 + 7], ids=["one-chunk", "mid-chunk"])
def test_async_partials_are_bitwise_the_local_kernel(store, metadata, n):
    for shard in ("shard-0", "shard-1", "shard-2"):
        store.start(shard)
    metadata.set_replication(2)
    token = metadata.add_tenant("alice")
    prefix, kv = published(store, token, n, seed=n)
    full = n // LAYOUT.chunk_tokens

    async def main():
        async with attending(store, token, prefix) as (client, session):
            assert len(session.chunks) == full and session.kernels_match()
            for layer, count in [(0, 1), (1, 5), (0, 3)]:
                q = query_rows(count, seed=layer * 10 + count)
                assert_bitwise(await session.query(layer, q), local(kv, full, layer, q))
            assert session.queries == 3 and session.bytes_received > 0
            with pytest.raises(InvalidArgument, match="layer"):
                await session.query(LAYOUT.num_layers, query_rows(1, seed=0))

    asyncio.run(main())


def test_async_shard_stopped_mid_session_fails_over_to_its_replica_bitwise(store, metadata):
    for shard in ("shard-0", "shard-1", "shard-2"):
        store.start(shard)
    metadata.set_replication(2)
    token = metadata.add_tenant("alice")
    prefix, kv = published(store, token, 16 * 6 + 3, seed=3)

    async def main():
        async with await connected(store, token) as client:
            session = await client.open_attention(prefix, HEADS, KERNEL)
            q = query_rows(4, seed=5)
            assert_bitwise(await session.query(0, q), local(kv, 6, 0, q))
            victim = client.topology.owners(session.chunks[0].parent)[0]
            store.stop(victim, grace_s=0)
            for layer in (1, 0):
                assert_bitwise(await session.query(layer, q), local(kv, 6, layer, q))
            assert victim in client.suspects()
            await session.close()

    asyncio.run(main())


def test_async_with_no_replica_left_a_query_fails(store, metadata):
    store.start("shard-0")
    token = metadata.add_tenant("alice")
    prefix, _ = published(store, token, 16 * 2, seed=0)

    async def main():
        async with attending(store, token, prefix) as (client, session):
            await session.query(0, query_rows(1, seed=0))
            store.stop("shard-0", grace_s=0)
            with pytest.raises((Unavailable, NotFound)):
                await session.query(1, query_rows(1, seed=0))

    asyncio.run(main())


def test_async_partials_corrupted_in_transit_are_read_from_a_replica(store, metadata):
    store.start("shard-0")
    store.start("shard-1")
    token = metadata.add_tenant("alice")
    prefix, kv = published(store, token, 16 * 3, seed=7)

    async def main():
        async with attending(store, token, prefix) as (client, session):
            fired = ATTEND.fired
            ATTEND.arm(1)
            try:
                q = query_rows(2, seed=9)
                assert_bitwise(await session.query(1, q), local(kv, 3, 1, q))
            finally:
                ATTEND.disarm()
            assert ATTEND.fired == fired + 1

    asyncio.run(main())


def test_async_quiet_stream_cut_by_the_shard_is_reopened_on_the_same_shard(store, metadata):
    server = store.start("shard-0", calls=CallBounds(stream_idle_s=0.3))
    token = metadata.add_tenant("alice")
    prefix, kv = published(store, token, 16 * 2, seed=0)

    async def main():
        async with attending(store, token, prefix) as (client, session):
            q = query_rows(2, seed=4)
            assert_bitwise(await session.query(0, q), local(kv, 2, 0, q))
            # the shard cancels the quiet stream: its call slot comes back
            idle = lambda: server.servicer.limits.in_flight() == 0  # noqa: E731
            assert await asyncio.to_thread(eventually, idle, timeout_s=5)
            assert_bitwise(await session.query(1, q), local(kv, 2, 1, q))
            assert client.suspects() == frozenset()

    asyncio.run(main())
    assert server.servicer.attend_stats.streams == 2
