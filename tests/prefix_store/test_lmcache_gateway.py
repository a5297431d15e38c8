"""The LMCache gateway driven by LMCache 0.5.6's own remote connector (`LMCServerConnector`,
the `lm://` backend) over real shards and Redis: round trips bitwise, misses, quotas, a bad
token, hostile frames, tenant isolation."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time

import pytest
import torch

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

from prefix_store.lmcache import GatewayConfig, GatewayError, LMCacheGateway  # noqa: E402
from prefix_store.lmcache.protocol import Command, client_header  # noqa: E402
from tests.waiting import eventually

LAYERS, HEADS, HEAD_DIM = 2, 2, 8  # LMCache KV_2LTD objects: [2, layers, tokens, heads * dim]
MODEL = "tiny-model"


class LMCacheClient:
    """LMCache's own client: `LMCServerConnector` over a CPU `LocalCPUBackend` (its
    allocator), on a private event loop."""

    def __init__(self, address: str) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        host, port = address.rsplit(":", 1)
        config = LMCacheEngineConfig.from_dict(
            {
                "chunk_size": 256,
                "local_cpu": False,
                "max_local_cpu_size": 0.05,
                "remote_url": f"lm://{address}",
                "remote_serde": "naive",
            }
        )
        metadata = LMCacheMetadata(
            model_name=MODEL,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.float32,
            kv_shape=(LAYERS, 2, 256, HEADS, HEAD_DIM),
            chunk_size=256,
        )
        quiet = logging.getLogger("lmcache.v1.storage_backend.local_cpu_backend")
        quiet.setLevel(logging.ERROR)
        self.backend = LocalCPUBackend(config, metadata, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        self.conn = LMCServerConnector(host, int(port), self.loop, self.backend)

    def object(self, tokens: int, dtype=torch.float32, seed: int = 0):
        """A backend-allocated KV chunk of `tokens` tokens, random values."""
        obj = self.backend.allocate(torch.Size([2, LAYERS, tokens, HEADS * HEAD_DIM]), dtype)
        assert obj is not None and obj.tensor is not None
        obj.tensor.copy_(
            torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(seed))
        )
        return obj

    def put(self, key, obj) -> None:
        self.loop.run_until_complete(self.conn.put(key, obj))

    def get(self, key):
        return self.loop.run_until_complete(self.conn.get(key))

    def exists(self, key) -> bool:
        return self.loop.run_until_complete(self.conn.exists(key))

    def close(self) -> None:
        self.loop.run_until_complete(self.conn.close())
        self.loop.close()
        self.backend.close()


def key(chunk_hash: int, dtype=torch.float32):
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(MODEL, 1, 0, chunk_hash, dtype)


def same(a, b) -> bool:
    return (
        a.get_shape() == b.get_shape()
        and a.get_dtype() == b.get_dtype()
        and a.get_memory_format() == b.get_memory_format()
        and torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8))
    )


@pytest.fixture
def gateway_for(store):
    """Start a gateway for a token (the store's shards must be started first)."""
    started: list[LMCacheGateway] = []
    clients: list[LMCacheClient] = []

    def start(token: str, **overrides) -> tuple[LMCacheGateway, LMCacheClient]:
        config = GatewayConfig(tuple(store.endpoints), token, **overrides)
        gateway = LMCacheGateway(config)
        gateway.start()
        started.append(gateway)
        client = LMCacheClient(gateway.address)
        clients.append(client)
        return gateway, client

    yield start
    for client in clients:
        client.close()
    for gateway in started:
        gateway.stop()


def test_round_trips_bitwise_for_several_chunk_sizes_and_dtypes(store, metadata, gateway_for):
    store.start()
    gateway, lmc = gateway_for(metadata.add_tenant("alice"))
    cases = [(256, torch.float32), (16, torch.float32), (1, torch.float32), (100, torch.bfloat16)]
    objects = [lmc.object(tokens, dtype, seed=i) for i, (tokens, dtype) in enumerate(cases)]
    for i, obj in enumerate(objects):
        lmc.put(key(i, obj.get_dtype()), obj)
    for i, obj in enumerate(objects):
        assert lmc.exists(key(i, obj.get_dtype()))
        got = lmc.get(key(i, obj.get_dtype()))
        assert got is not None and same(got, obj), cases[i]
    assert gateway.stats.snapshot()["puts"] == len(cases)


def test_a_missing_key_is_a_miss_and_the_connection_goes_on(store, metadata, gateway_for):
    store.start()
    _, lmc = gateway_for(metadata.add_tenant("alice"))
    assert not lmc.exists(key(404))
    assert lmc.get(key(404)) is None
    assert not lmc.exists(key(1, torch.bfloat16))  # same hash, another dtype: another key
    obj = lmc.object(8)
    lmc.put(key(404), obj)
    assert lmc.exists(key(404)) and same(lmc.get(key(404)), obj)


def test_a_tenant_over_quota_stores_nothing_and_keeps_its_data(store, metadata, gateway_for):
    store.start()
    one = 2 * LAYERS * 64 * HEADS * HEAD_DIM * 4  # a 64-token fp32 object
    gateway, lmc = gateway_for(metadata.add_tenant("alice", quota=one + one // 2))
    first, second = lmc.object(64, seed=1), lmc.object(64, seed=2)
    lmc.put(key(1), first)
    lmc.put(key(2), second)  # over quota: LMCache's protocol has no PUT reply
    assert not lmc.exists(key(2)) and lmc.get(key(2)) is None
    lmc.put(key(1), second)  # replacing would also pass the quota: refused, old kept
    assert same(lmc.get(key(1)), first)
    refused = gateway.stats.snapshot().get("put_refused:QuotaExceeded", 0)
    assert refused == 2


def test_an_unknown_token_fails_the_start_without_showing_it(store, metadata):
    store.start()
    token = "not-a-real-token-abcdef"
    with pytest.raises(GatewayError, match="UNAUTHENTICATED") as error:
        LMCacheGateway(GatewayConfig(tuple(store.endpoints), token)).start()
    assert token not in str(error.value)
    assert token not in repr(GatewayConfig(tuple(store.endpoints), token))


def test_an_unknown_namespace_fails_the_start(store, metadata):
    store.start()
    token = metadata.add_tenant("alice")
    with pytest.raises(GatewayError, match="namespace 'nope'"):
        LMCacheGateway(GatewayConfig(tuple(store.endpoints), token, namespace="nope")).start()


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_hostile_frames_close_their_connection_only(store, metadata, gateway_for):
    store.start()
    gateway, lmc = gateway_for(metadata.add_tenant("alice"), max_object_bytes=1 << 20)
    obj = lmc.object(16)
    lmc.put(key(7), obj)
    host, port = gateway.address.rsplit(":", 1)
    hostile = [
        client_header(Command.PUT, "m@1@0@7@float32", length=(1 << 31) - 1),  # oversized
        client_header(Command.PUT, "m@1@0@7@float32", length=-5),
        struct.pack("=9i", 99, 0, 1, 4, 0, 0, 0, 0, 0) + b" " * 150,  # unknown command
        client_header(Command.GET, "m@1@0@7@float32")[:36] + b"\xff" * 150,  # not UTF-8
    ]
    for frame in hostile:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(frame)
            assert closed_by_peer(sock)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(client_header(Command.PUT, "m@1@0@8@float32", length=1000)[:100])
        # a peer that stops mid-header holds only its own connection
        assert lmc.exists(key(7)) and same(lmc.get(key(7)), obj)
    assert gateway.stats.snapshot()["protocol_errors"] == len(hostile)


def test_connections_beyond_the_limit_are_closed(store, metadata, gateway_for):
    store.start()
    gateway, lmc = gateway_for(metadata.add_tenant("alice"), max_connections=1)
    assert not lmc.exists(key(1))  # lmc holds the one connection
    host, port = gateway.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        assert closed_by_peer(sock)
    assert gateway.stats.snapshot()["connections_refused"] == 1
    assert not lmc.exists(key(1))


def test_two_tenants_gateways_cannot_see_each_others_keys(store, metadata, gateway_for):
    store.start()
    _, alice = gateway_for(metadata.add_tenant("alice"))
    _, bob = gateway_for(metadata.add_tenant("bob"))
    mine, theirs = alice.object(32, seed=1), bob.object(32, seed=2)
    alice.put(key(5), mine)
    assert not bob.exists(key(5)) and bob.get(key(5)) is None
    bob.put(key(5), theirs)
    assert same(alice.get(key(5)), mine) and same(bob.get(key(5)), theirs)


def test_objects_are_replicated_and_survive_a_shard(store, metadata, gateway_for):
    metadata.set_replication(2)
    store.start("shard-0")
    store.start("shard-1")
    _, lmc = gateway_for(metadata.add_tenant("alice"))
    objects = [lmc.object(16, seed=i) for i in range(6)]
    for i, obj in enumerate(objects):
        lmc.put(key(i), obj)
    store.stop("shard-1", grace_s=0)
    for i, obj in enumerate(objects):
        got = lmc.get(key(i))
        assert got is not None and same(got, obj), i


# ---- key and layout mapping ---------------------------------------------------------------


def lmcache_database(chunk_size: int, hash_fn=None, unfull: bool = False):
    """LMCache's own ChunkedTokenDatabase for the tiny model (no vLLM here: builtin hash,
    NONE_HASH 0, unless `hash_fn` replaces the hash as vLLM's would)."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    config = LMCacheEngineConfig.from_dict({"chunk_size": chunk_size, "save_unfull_chunk": unfull})
    metadata = LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float32,
        kv_shape=(LAYERS, 2, chunk_size, HEADS, HEAD_DIM),
        chunk_size=chunk_size,
    )
    logging.getLogger("lmcache.v1.token_database").setLevel(logging.ERROR)
    database = ChunkedTokenDatabase(config, metadata)
    if hash_fn is not None:
        database.hash_func = hash_fn
    return database


@pytest.mark.parametrize("unfull", [False, True])
@pytest.mark.parametrize("algorithm", ["builtin", "sha256_cbor_64bit"])
def test_lmcache_keys_are_lmcache_s_own(algorithm, unfull):
    from prefix_store.keys import sha256_cbor_64bit
    from prefix_store.lmcache.mapping import LMCacheKeying, lmcache_keys

    tokens = list(range(1000, 1040))
    hash_fn = sha256_cbor_64bit if algorithm != "builtin" else None
    database = lmcache_database(16, hash_fn, unfull)
    theirs = [k.to_string() for _, _, k in database.process_tokens(tokens)]
    keying = LMCacheKeying(MODEL, "float32", 16, hash_algorithm=algorithm, save_unfull_chunk=unfull)
    assert lmcache_keys(tokens, keying) == theirs and len(theirs) == 2 + unfull


def test_a_prefix_stored_through_lmcache_is_found_by_tokens_and_imported_unsigned(
    store, metadata, gateway_for
):
    from lmcache.utils import parse_cache_key

    from prefix_store.layout import KVLayout
    from prefix_store.lmcache.mapping import (
        LMCacheKeying,
        find_prefix,
        import_prefix,
        kv_to_naive,
        lmcache_keys,
    )

    store.start()
    token = metadata.add_tenant("alice")
    gateway, lmc = gateway_for(token)
    layout = KVLayout(f"{MODEL}@1", "float32", LAYERS, HEADS, HEAD_DIM, chunk_tokens=16)
    keying = LMCacheKeying(MODEL, "float32", chunk_size=16, save_unfull_chunk=True)
    tokens = list(range(500, 540))  # chunks of 16, 16 and 8 tokens
    kv = torch.randn(LAYERS, 2, HEADS, len(tokens), HEAD_DIM)  # VeriCache's [L, 2, H, T, D]
    for key_string, start in zip(lmcache_keys(tokens, keying), (0, 16, 32), strict=True):
        part = kv_to_naive(kv[:, :, :, start : start + 16])
        obj = lmc.object(part.shape[2])
        obj.tensor.copy_(part)
        lmc.put(parse_cache_key(key_string), obj)
    assert lmc.exists(parse_cache_key(key_string))  # PUTs have no reply: a reply orders them
    covered, found = find_prefix(gateway.objects, tokens, keying, layout)
    assert covered == len(tokens) and torch.equal(found, kv)
    assert find_prefix(gateway.objects, [7, *tokens[1:]], keying, layout) == (0, None)
    other = KVLayout(f"{MODEL}@1", "float32", LAYERS + 1, HEADS, HEAD_DIM, chunk_tokens=16)
    assert find_prefix(gateway.objects, tokens, keying, other) == (0, None)  # geometry differs

    assert import_prefix(gateway.objects, gateway.client, tokens, keying, layout) is not None
    with store.client(token) as client:
        prefix = client.lookup(tokens, layout)
        assert prefix.tokens == len(tokens)
        assert all(not chunk.proof.signature for chunk in prefix.chunks)  # never verified
        k = torch.empty(LAYERS, HEADS, len(tokens), HEAD_DIM)
        v = torch.empty_like(k)
        client.fetch_layers(prefix, k, v)
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])


def test_has_artifact_probes_without_fetching_sync_and_async(store, metadata):
    """The one SDK addition the gateway's EXIST uses, in both client shells."""
    from prefix_store.client import AsyncStoreClient
    from prefix_store.lmcache.objects import Envelope, ObjectStore
    from prefix_store.lmcache.protocol import ObjectMeta

    store.start()
    token = metadata.add_tenant("alice")
    with store.client(token) as client:
        objects = ObjectStore(client)
        stored, payload = Envelope.buffer("k@1@0@1@float", ObjectMeta(1, 4, (1, 0, 0, 0)), 300_000)
        payload[:] = (bytes(range(256)) * 1172)[:300_000]
        objects.put("k@1@0@1@float", bytes(stored))
        assert objects.exists("k@1@0@1@float") and not objects.exists("k@1@0@2@float")
        prefix = objects._prefix("k@1@0@1@float")

    async def probe() -> tuple[bool, bool]:
        aio = await AsyncStoreClient.connect(store.endpoints, token)
        try:
            return (
                await aio.has_artifact(prefix, "lmcache:k@1@0@1@float"),
                await aio.has_artifact(prefix, "lmcache:k@1@0@2@float"),
            )
        finally:
            await aio.close()

    assert asyncio.run(probe()) == (True, False)


NOBODY = 65534
AS_NOBODY = r"""exec 3<>"/dev/tcp/$1/$2" && printf "$3" >&3 && timeout 10 head -c 1 <&3 | wc -c"""
"""Connect with bash (any user may run it), send a frame, count the reply's first byte."""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_a_process_of_another_user_is_refused_and_counted(store, metadata, gateway_for):
    """A HEALTH frame from uid 65534 gets no answer: the connection is closed at once;
    the gateway's own user is served, and a configured uid is admitted."""
    import subprocess

    store.start()
    token = metadata.add_tenant("alice")
    gateway, lmc = gateway_for(token)

    def as_nobody(address: str) -> str:
        host, port = address.rsplit(":", 1)
        frame = "".join(f"\\x{byte:02x}" for byte in client_header(Command.HEALTH, "health"))
        args = ["/bin/bash", "-c", AS_NOBODY, "as-nobody", host, port, frame]
        got = subprocess.run(args, user=NOBODY, cwd="/", capture_output=True, text=True, timeout=60)
        return {"0": "closed", "1": "answered"}.get(got.stdout.strip(), got.stderr)

    assert as_nobody(gateway.address) == "closed"
    assert gateway.stats.snapshot()["connections_refused_uid"] == 1
    assert not lmc.exists(key(1))  # the gateway's own user is served
    allowed, _ = gateway_for(token, allowed_uids=(NOBODY,))
    assert as_nobody(allowed.address) == "answered"
    assert "connections_refused_uid" not in allowed.stats.snapshot()


def resident_bytes() -> int:
    """This process's resident memory (the gateway runs in it)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_put_declaring_a_large_payload_holds_only_what_arrived(store, metadata, gateway_for):
    """A PUT that declares 256 MiB and sends 1 KiB grows the gateway's resident memory by
    about what arrived, not 256 MiB: its final buffer is backed only as its bytes land."""
    store.start()
    gateway, lmc = gateway_for(metadata.add_tenant("alice"))
    assert not lmc.exists(key(1))  # LMCache's connection is being served
    host, port = gateway.address.rsplit(":", 1)
    before, held = resident_bytes(), gateway.connections()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(client_header(Command.PUT, "m@1@0@9@float32", length=256 << 20))
        sock.sendall(b"x" * 1024)
        assert eventually(lambda: gateway.connections() == held + 1)
        time.sleep(0.5)  # the gateway has read the 1 KiB and waits for the rest
        grown = resident_bytes() - before
    assert eventually(lambda: gateway.connections() == held)  # our close ended it
    assert grown < 32 << 20, grown


def test_a_put_cut_short_while_it_is_forwarded_stores_nothing(store, metadata, gateway_for):
    """A PUT is sent on to the shards while it arrives: one whose payload stops short ends
    those transfers, and nothing of it is stored, charged or left pinned."""
    server = store.start()
    gateway, lmc = gateway_for(metadata.add_tenant("alice"))
    assert not lmc.exists(key(1))
    host, port = gateway.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(client_header(Command.PUT, "m@1@0@9@float32", length=3 << 20))
        sock.sendall(b"x" * (1 << 20))
        assert eventually(lambda: server.data_plane.load()[1] == 1)  # forwarding already
    assert eventually(lambda: gateway.stats.snapshot().get("put_refused:Aborted") == 1)
    assert eventually(lambda: server.data_plane.load() == (0, 0))
    assert server.shard.counts()["artifacts"] == 0
    assert server.shard.usage().get("alice", 0) == 0
    assert not lmc.exists(key(9))
