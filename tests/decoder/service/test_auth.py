"""The Decoder service authenticates before it reads (or tokenizes) a request, keeps a
bounded set of store clients, and leaks no secret.

Real components on loopback: a redis-server, a store shard, a decoder server with the
built-in model. A hostile client is plain gRPC with raw bytes (no project code).
"""

from __future__ import annotations

import logging
import os
import time

import grpc
import pytest
from vericache.v1 import decoder_pb2 as dpb

from cluster.redis_server import RedisServer
from decoder.service.client import DecoderClient
from prefix_store.metadata import Metadata
from tests.decoder.service.conftest import serve
from tests.prefix_store.conftest import Store
from tests.waiting import eventually

SERVICE = dpb.DESCRIPTOR.services_by_name["Decoder"]
METHODS = [m.name for m in SERVICE.methods]
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, runs past the end
HUGE_TEXT = "hello world " * (32 * 2**20 // 12)  # 32 MiB: about 30 s of tokenizing here
NO_TOKEN = ()
JUNK = (("authorization", "Bearer not-a-token"),)
NOT_BEARER = (("authorization", "Basic dXNlcjpwdw=="),)
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def auth(token: str):
    return (("authorization", f"Bearer {token}"),)


def raw_call(channel: grpc.Channel, name: str, payload: bytes, metadata, timeout: float = 20):
    """`name` called with `payload` as its request, bytes in and out: (code, details)."""
    path = f"/{SERVICE.full_name}/{name}"
    if SERVICE.methods_by_name[name].server_streaming:
        call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
    else:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    try:
        reply = call(payload, metadata=metadata, timeout=timeout)
        if SERVICE.methods_by_name[name].server_streaming:
            list(reply)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def connections_to(port: int) -> int:
    """TCP connections this process holds open to `port` (its client side)."""
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            sockets.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                count += remote_port == port and fields[3] == "01" and fields[9] in sockets
    return count


@pytest.fixture
def decoder(store, builtin_model):
    server = serve(store.endpoints, builtin_model)
    yield server
    server.stop(0)


@pytest.fixture(scope="module")
def huge():
    """32 MiB prompts, serialised once."""
    return {
        "Generate": dpb.GenerateRequest(text=HUGE_TEXT, max_new_tokens=4).SerializeToString(),
        "Publish": dpb.PublishRequest(text=HUGE_TEXT).SerializeToString(),
        "Info": dpb.GenerateRequest(text=HUGE_TEXT).SerializeToString(),
    }


@pytest.mark.parametrize("name", METHODS)
def test_a_caller_without_a_known_token_learns_only_unauthenticated_and_fast(decoder, huge, name):
    with grpc.insecure_channel(decoder.address) as channel:
        for metadata in (NO_TOKEN, JUNK, NOT_BEARER):
            for payload in (b"", GARBAGE, huge[name]):
                started = time.monotonic()
                code, details = raw_call(channel, name, payload, metadata)
                assert code == UNAUTHENTICATED, (metadata, len(payload), code, details)
                assert details.startswith("authorization:"), details
                assert time.monotonic() - started < 5  # nothing was tokenized
    assert decoder.worker.cached_clients() == 0


def test_a_known_caller_gets_info_and_invalid_argument_for_garbage(decoder, metadata):
    token = metadata.add_tenant("alice")
    with DecoderClient(decoder.address, token) as client:
        assert client.info().worker_id == decoder.config.worker_id
    with grpc.insecure_channel(decoder.address) as channel:
        for name in METHODS:
            code, details = raw_call(channel, name, GARBAGE, auth(token))
            message = SERVICE.methods_by_name[name].input_type.name
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
            assert details.startswith(f"{message}: malformed message"), details
    assert decoder.worker.cached_clients() == 1


def test_a_rotated_token_is_refused_and_its_client_let_go(decoder, metadata):
    old = metadata.add_tenant("alice")
    with grpc.insecure_channel(decoder.address) as channel:
        assert raw_call(channel, "Info", b"", auth(old))[0] == grpc.StatusCode.OK
        assert decoder.worker.cached_clients() == 1
        new = metadata.rotate_token("alice")

        def refused() -> bool:
            return raw_call(channel, "Info", b"", auth(old))[0] == UNAUTHENTICATED

        assert eventually(refused, timeout_s=10)  # the store's cache and ours: 2 s each
        assert decoder.worker.cached_clients() == 0
        for name in METHODS:
            assert raw_call(channel, name, GARBAGE, auth(old))[0] == UNAUTHENTICATED
        assert raw_call(channel, "Info", b"", auth(new))[0] == grpc.StatusCode.OK


def test_unknown_tokens_leave_no_client_and_the_kept_ones_are_bounded(
    store, metadata, builtin_model
):
    server = serve(store.endpoints, builtin_model, store_clients=2)
    port = int(store.endpoints[0].rsplit(":", 1)[1])
    try:
        with grpc.insecure_channel(server.address) as channel:
            for i in range(20):
                for name in METHODS:
                    code, _ = raw_call(channel, name, b"", auth(f"junk-{i}"))
                    assert code == UNAUTHENTICATED
            assert server.worker.cached_clients() == 0
            # one shared connection checks unknown tokens: none is opened per token
            assert eventually(lambda: connections_to(port) == 1), connections_to(port)
            tokens = [metadata.add_tenant(f"tenant-{i}") for i in range(5)]
            for token in tokens + tokens:  # the second round rebuilds the evicted ones
                assert raw_call(channel, "Info", b"", auth(token))[0] == grpc.StatusCode.OK
                assert server.worker.cached_clients() <= 2
            assert server.worker.cached_clients() == 2
            assert eventually(lambda: connections_to(port) == 3), connections_to(port)
    finally:
        server.stop(0)
    assert eventually(lambda: connections_to(port) == 0), connections_to(port)


def redis_gets(url: str) -> int:
    import redis

    return redis.Redis.from_url(url).info("commandstats").get("cmdstat_get", {}).get("calls", 0)


def test_unknown_tokens_from_one_caller_cost_a_bounded_number_of_store_checks(
    decoder, store, metadata
):
    """1,000 distinct unknown tokens from one address: the decoder asks the store (one
    Describe, one Redis GET there) for at most its per-address burst plus refill, over one
    shared connection; the rest are RESOURCE_EXHAUSTED naming the limit, before any I/O.
    A known caller from the same address is still served."""
    token = metadata.add_tenant("alice")
    bounds = decoder.worker._clients.throttle.bounds
    with grpc.insecure_channel(decoder.address) as channel:
        assert raw_call(channel, "Info", b"", auth(token))[0] == grpc.StatusCode.OK
        before, started = redis_gets(store.redis_url), time.monotonic()
        answers = [raw_call(channel, "Info", b"", auth(f"vc_junk-{i}")) for i in range(1000)]
        gets = redis_gets(store.redis_url) - before
        allowed = bounds.failures_burst + bounds.failures_per_s * (time.monotonic() - started)
        assert gets <= allowed + 1, (gets, allowed)
        codes = [code for code, _ in answers]
        assert set(codes) == {UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
        refused = next(d for c, d in answers if c == grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert refused.startswith("authorization: too many unknown tokens from this peer")
        assert raw_call(channel, "Info", b"", auth(token))[0] == grpc.StatusCode.OK
    assert decoder.worker.cached_clients() == 1
    port = int(store.endpoints[0].rsplit(":", 1)[1])
    assert connections_to(port) <= 2  # alice's client and the shared check


def test_an_evicted_client_stays_open_while_a_cached_prefix_reads_through_it(
    store, metadata, builtin_model
):
    """Tenant a's client reads the shared prefix it found; c's call evicts that client
    from the cache, and b's request over the same prefix still reads through it."""
    tokens = {name: metadata.add_tenant(name) for name in ("a", "b", "c")}
    metadata.add_shared("docs", ["a", "b"])
    server = serve(store.endpoints, builtin_model, store_clients=1)
    doc = list(range(1000, 1100))
    try:
        with DecoderClient(server.address, tokens["a"]) as a:
            a.publish(token_ids=doc, namespace="docs", compressors=[])
            first = a.generate(token_ids=doc + [7], max_new_tokens=4, namespace="docs")
        assert first.stats["cached_tokens"] > 0
        with DecoderClient(server.address, tokens["c"]) as c:
            c.info()  # a's client is evicted (the bound is 1)
        shard = store.servers["shard-0"].shard
        fetched = shard.stats.fetched_bytes
        with DecoderClient(server.address, tokens["b"]) as b:
            again = b.generate(token_ids=doc + [7], max_new_tokens=4, namespace="docs")
        assert again.tokens == first.tokens
        assert again.stats["cached_tokens"] == first.stats["cached_tokens"]
        assert shard.stats.fetched_bytes > fetched  # read from the store, not recomputed
    finally:
        server.stop(0)


PASSWORD = "s3cret-Redis-pw_for.this~test"


def test_no_caller_and_no_log_line_sees_the_redis_url_while_redis_is_down(
    tmp_path, builtin_model, caplog
):
    caplog.set_level(logging.INFO)
    redis = RedisServer(tmp_path / "redis", password=PASSWORD).start()
    store = Store(redis.url, tmp_path)
    server = None
    try:
        token = Metadata(redis.url).add_tenant("alice")
        store.start()
        server = serve(store.endpoints, builtin_model)
        requests = {
            "Generate": dpb.GenerateRequest(
                token_ids=dpb.TokenIds(ids=[5, 6, 7]), max_new_tokens=2, mode="full"
            ).SerializeToString(),
            "Publish": dpb.PublishRequest(token_ids=dpb.TokenIds(ids=[5, 6])).SerializeToString(),
            "Info": b"",
        }
        with grpc.insecure_channel(server.address) as channel:
            assert raw_call(channel, "Info", b"", auth(token))[0] == grpc.StatusCode.OK
            redis.stop()
            rounds = []  # every method as each caller, until the shard's token cache has
            # expired and it asks Redis: then someone is told UNAVAILABLE

            def unavailable() -> bool:
                rounds.append(
                    [
                        raw_call(channel, name, requests[name], metadata)
                        for metadata in (JUNK, auth(token), auth("never-seen"))
                        for name in METHODS
                    ]
                )
                return grpc.StatusCode.UNAVAILABLE in {code for code, _ in rounds[-1]}

            assert eventually(unavailable, timeout_s=15, every_s=0.2)
            for code, details in (answer for answers in rounds for answer in answers):
                assert code != grpc.StatusCode.UNKNOWN
                for secret in (PASSWORD, redis.url, f"{redis.host}:{redis.port}", "redis://"):
                    assert secret not in details, (code, details)
            redis.start()
            recovered = eventually(
                lambda: (
                    raw_call(channel, "Generate", requests["Generate"], auth(token))[0]
                    == grpc.StatusCode.OK
                ),
                timeout_s=15,
                every_s=0.2,
            )
            assert recovered, "no recovery once Redis is back"
            assert raw_call(channel, "Info", b"", JUNK)[0] == UNAUTHENTICATED
    finally:
        if server is not None:
            server.stop(0)
        store.close()
        redis.stop()
    assert PASSWORD not in caplog.text


def test_a_shared_prefix_is_read_with_each_reader_s_own_client(store, metadata, builtin_model):
    """Two members decode over one shared prefix, held once: the reads made for a request
    go through its reader's own store client (its quota, shares and audit), not the first
    reader's."""
    tokens = {name: metadata.add_tenant(name) for name in ("a", "b")}
    metadata.add_shared("docs", ["a", "b"])
    server = serve(store.endpoints, builtin_model)
    doc = list(range(1000, 1100))
    try:
        with DecoderClient(server.address, tokens["a"]) as a:
            a.publish(token_ids=doc, namespace="docs", compressors=[])
            first = a.generate(token_ids=doc + [7], max_new_tokens=4, namespace="docs")
        with DecoderClient(server.address, tokens["b"]) as b:
            again = b.generate(token_ids=doc + [7], max_new_tokens=4, namespace="docs")
        assert again.tokens == first.tokens and again.stats["cached_tokens"] > 0
        (entry,) = server.worker.prefixes.entries()  # one copy for both readers
        assert entry.prefix.source.client.topology.tenant == "b"
    finally:
        server.stop(0)
