"""The PrefixStore authenticates before it reads a request, and leaks no secret.

A hostile client here is plain gRPC with raw bytes (no project code): whatever it sends,
a caller without a known token learns UNAUTHENTICATED and nothing else. Servers and Redis
are real (loopback); one test stops its own redis-server and starts it again.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
from vericache.v1 import prefix_store_pb2 as pb

from cluster.redis_server import RedisServer
from prefix_store.metadata import Metadata
from prefix_store.metadata.records import redact_url
from prefix_store.throttle import AuthBounds
from tests.prefix_store.conftest import Store
from tests.waiting import eventually

SERVICE = pb.DESCRIPTOR.services_by_name["PrefixStore"]
METHODS = [m.name for m in SERVICE.methods]
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, runs past the end
NO_TOKEN = ()
JUNK = (("authorization", "Bearer not-a-token"),)
NOT_BEARER = (("authorization", "Basic dXNlcjpwdw=="),)


def auth(token: str):
    return (("authorization", f"Bearer {token}"),)


def raw_call(channel: grpc.Channel, name: str, payload: bytes, metadata, timeout: float = 10):
    """`name` called with `payload` as its request (or its stream's one message), bytes in
    and out: (status code, details)."""
    method = SERVICE.methods_by_name[name]
    path = f"/{SERVICE.full_name}/{name}"
    if method.client_streaming:
        call = channel.stream_unary(path, request_serializer=None, response_deserializer=None)
        request = iter([payload])
    elif method.server_streaming:
        call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
        request = payload
    else:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        request = payload
    try:
        reply = call(request, metadata=metadata, timeout=timeout)
        if method.server_streaming:
            list(reply)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.fixture
def channel(store):
    store.start()
    with grpc.insecure_channel(store.endpoints[0]) as channel:
        yield channel


@pytest.mark.parametrize("name", METHODS)
def test_a_caller_without_a_known_token_learns_only_unauthenticated(channel, name):
    for metadata in (NO_TOKEN, JUNK, NOT_BEARER):
        for payload in (b"", GARBAGE):
            code, details = raw_call(channel, name, payload, metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (metadata, payload, details)
            assert details.startswith("authorization:"), details


@pytest.mark.parametrize("name", [m.name for m in SERVICE.methods if m.client_streaming])
def test_a_stream_is_refused_before_its_first_message(channel, name):
    """The caller sends nothing and holds its stream open: it is refused at once."""
    release = threading.Event()

    def nothing_yet():
        release.wait(30)
        yield b""

    path = f"/{SERVICE.full_name}/{name}"
    call = channel.stream_unary(path, request_serializer=None, response_deserializer=None)
    started = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as error:
            call(nothing_yet(), metadata=JUNK, timeout=5)
    finally:
        release.set()
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert time.monotonic() - started < 3


# (Put always read its raw messages itself, with `wire`; test_server covers it.)
@pytest.mark.parametrize("name", [name for name in METHODS if name != "Put"])
def test_garbage_from_a_known_caller_is_invalid_argument_naming_its_message(
    channel, metadata, name
):
    token = metadata.add_tenant("alice")
    code, details = raw_call(channel, name, GARBAGE, auth(token))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    message = SERVICE.methods_by_name[name].input_type.name
    assert details.startswith(f"{message}: malformed message"), details


PASSWORD = "s3cret-Redis-pw_for.this~test"


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own (so stopping it disturbs no other test)."""
    server = RedisServer(tmp_path / "redis", password=PASSWORD).start()
    yield server
    server.stop()


def test_no_caller_and_no_log_line_sees_the_redis_url_while_redis_is_down(
    own_redis, tmp_path, caplog
):
    caplog.set_level(logging.INFO)
    url = own_redis.url
    host_port = f"{own_redis.host}:{own_redis.port}"
    token = Metadata(url).add_tenant("alice")
    store = Store(url, tmp_path)
    store.start(auth=AuthBounds(cache_s=1.0))  # the cached token expires within the test
    try:
        with grpc.insecure_channel(store.endpoints[0]) as channel:
            assert raw_call(channel, "Describe", b"", auth(token))[0] == grpc.StatusCode.OK
            own_redis.stop()
            # a token cached by the shard (the handler then needs Redis), then not cached
            answers = [raw_call(channel, name, b"", auth(token)) for name in METHODS]
            time.sleep(1.2)  # past cache_s: the token is no longer cached
            for metadata in (JUNK, auth(token)):
                answers += [raw_call(channel, name, b"", metadata) for name in METHODS]
            unavailable = [d for code, d in answers if code == grpc.StatusCode.UNAVAILABLE]
            assert len(unavailable) >= 2 * len(METHODS)
            for code, details in answers:
                assert code != grpc.StatusCode.UNKNOWN
                for secret in (PASSWORD, url, host_port, "redis://"):
                    assert secret not in details, (code, details)
            own_redis.start()
            deadline = time.monotonic() + 10
            while raw_call(channel, "Describe", b"", auth(token))[0] != grpc.StatusCode.OK:
                assert time.monotonic() < deadline, "the shard did not recover with Redis"
                time.sleep(0.1)
            assert raw_call(channel, "Stats", b"", auth(token))[0] == grpc.StatusCode.OK
            assert raw_call(channel, "Stats", b"", JUNK)[0] == grpc.StatusCode.UNAUTHENTICATED
    finally:
        store.close()
    assert PASSWORD not in caplog.text
    assert redact_url(url) in caplog.text  # the operator's log says where it looked


def test_redact_url_masks_the_password_only():
    assert redact_url("redis://:pw@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert redact_url("rediss://user:pw@h:1/2?password=pw&db=1") == (
        "rediss://user:***@h:1/2?password=***&db=1"
    )
    assert redact_url("redis://pw@[::1]:5") == "redis://***@[::1]:5"
    assert redact_url("redis://localhost:6379/0") == "redis://localhost:6379/0"


def redis_gets(url: str) -> int:
    """GETs the redis-server at `url` has served (INFO commandstats)."""
    import redis

    return redis.Redis.from_url(url).info("commandstats").get("cmdstat_get", {}).get("calls", 0)


def test_unknown_tokens_from_one_peer_cost_a_bounded_number_of_redis_gets(store, metadata):
    """1,000 distinct unknown tokens from one address: Redis is asked at most the peer's
    burst plus its refill (not once per token); the rest are refused before any I/O with
    RESOURCE_EXHAUSTED naming the limit; a token the shard knows keeps working."""
    bounds = AuthBounds(failures_burst=10, failures_per_s=1.0)
    store.start(auth=bounds)
    token = metadata.add_tenant("alice")
    with grpc.insecure_channel(store.endpoints[0]) as channel:
        assert raw_call(channel, "Describe", b"", auth(token))[0] == grpc.StatusCode.OK
        before, started = redis_gets(store.redis_url), time.monotonic()
        answers = [raw_call(channel, "Describe", b"", auth(f"vc_junk-{i}")) for i in range(1000)]
        gets = redis_gets(store.redis_url) - before
        allowed = bounds.failures_burst + bounds.failures_per_s * (time.monotonic() - started)
        assert gets <= allowed + 1, (gets, allowed)
        codes = [code for code, _ in answers]
        assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert codes.count(grpc.StatusCode.UNAUTHENTICATED) <= allowed + 1
        refused = next(d for c, d in answers if c == grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "too many unknown tokens from this peer (at most 10 at once" in refused
        assert raw_call(channel, "Describe", b"", auth(token))[0] == grpc.StatusCode.OK


def test_a_known_token_is_rechecked_unthrottled_and_rotation_still_applies(store, metadata):
    """A throttled peer's known token is asked about again when its cache ends (so rotation
    takes effect within cache_s) without being refused for the peer's failures."""
    store.start(auth=AuthBounds(cache_s=0.2, failures_burst=1, failures_per_s=0.01))
    token = metadata.add_tenant("alice")
    with grpc.insecure_channel(store.endpoints[0]) as channel:
        assert raw_call(channel, "Describe", b"", auth(token))[0] == grpc.StatusCode.OK
        assert raw_call(channel, "Describe", b"", auth("junk-1"))[0] == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        refused = raw_call(channel, "Describe", b"", auth("junk-2"))
        assert refused[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, refused

        def rechecked() -> bool:  # the known token, past cache_s: Redis is asked again
            before = redis_gets(store.redis_url)
            assert raw_call(channel, "Describe", b"", auth(token))[0] == grpc.StatusCode.OK
            return redis_gets(store.redis_url) > before

        assert eventually(rechecked)
        metadata.rotate_token("alice")
        assert eventually(
            lambda: (
                raw_call(channel, "Describe", b"", auth(token))[0]
                == grpc.StatusCode.UNAUTHENTICATED
            )
        )
