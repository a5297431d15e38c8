"""The router over real decoder servers (real gRPC, a real shard and Redis, the built-in
model): outputs identical to in-process full-KV decoding, prefix affinity, a burst that
spills, a decoder stopped mid-stream, a decoder added, auth and tenants unchanged."""

from __future__ import annotations

import inspect
import textwrap
import threading

import pytest

from decoder.router import RouterConfig, RouterServer
from decoder.router.identity import prefix_identity
from decoder.router.policies.affinity import rendezvous
from decoder.router.server import load_tokenizer
from decoder.sampling import SamplingParams
from decoder.service.client import DecoderClient, GenerateReply
from decoder.service.config import MAX_NEW_TOKENS
from prefix_store.config import ClientConfig
from prefix_store.errors import NotFound, Unauthenticated
from tests.decoder.service.conftest import serve
from tests.references import full_kv_tokens

NEW = 12


@pytest.fixture
def decoders(store, builtin_model):
    servers = [serve(store.endpoints, builtin_model, worker_id=f"decoder-{i}") for i in range(2)]
    yield servers
    for server in servers:
        server.stop(grace_s=0)


def start_router(store, decoders, **overrides):
    config = RouterConfig(
        tuple(store.endpoints),
        decoders=tuple(d.address for d in decoders),
        client=ClientConfig(timeout_s=10, retries=2, backoff_s=0.05),
        poll_s=0.2,
        **overrides,
    )
    router = RouterServer(config, tokenizer=TOKENIZER)
    router.start()
    return router


TOKENIZER = None


@pytest.fixture(scope="module", autouse=True)
def tokenizer():
    global TOKENIZER
    TOKENIZER = load_tokenizer(None)
    yield


def documents(model, count: int) -> list[list[int]]:
    """`count` distinct 600-token prompts (at most 48), each starting 300 characters after
    the last. Which decoder owns each depends on the tenant's random salt, so a test picking
    one by owner draws from many: with 6, all five others went to the first's decoder
    about 1 run in 32."""
    text = inspect.getsource(textwrap)
    return [model.encode(text[i * 300 :])[:600] for i in range(count)]


def reference(runner, model, prompt, sampling=None):
    return full_kv_tokens(runner, model, prompt, NEW, sampling)


def owner(doc, salt, decoders):
    return rendezvous(prefix_identity(doc, salt, 2), [d.address for d in decoders])[0]


def test_routed_outputs_are_full_kv_and_a_prefix_stays_on_one_decoder(
    store, decoders, metadata, builtin_model, builtin_runner
):
    router = start_router(store, decoders)
    token = metadata.add_tenant("alice")
    with DecoderClient(router.address, token) as client:
        salt = client_salt(store, token)
        docs = documents(builtin_model, 48)
        a = docs[0]
        b = next(d for d in docs[1:] if owner(d, salt, decoders) != owner(a, salt, decoders))
        question = builtin_model.encode("\n# In one line:")[1:]
        client.publish(token_ids=a, compressors=["snapkv:budget=0.25"])
        sampled = {"temperature": 0.8, "top_k": 40}  # no seed: the router assigns one
        replies = [
            client.generate(token_ids=a + question, max_new_tokens=NEW),
            client.generate(token_ids=a + question[:2], max_new_tokens=NEW, **sampled),
            client.generate(token_ids=b + question, max_new_tokens=NEW),
        ]
    workers = [r.stats["worker"] for r in replies]
    assert workers[0] == workers[1] != workers[2]
    seed = replies[1].stats["seed"]
    assert replies[0].tokens == reference(builtin_runner, builtin_model, a + question)
    assert replies[1].tokens == reference(
        builtin_runner, builtin_model, a + question[:2], SamplingParams(0.8, 40, 1.0, seed)
    )
    assert replies[2].tokens == reference(builtin_runner, builtin_model, b + question)
    assert all(r.stats["router"]["failovers"] == 0 for r in replies)
    router.stop(0)


def test_a_decoder_stopped_mid_stream_is_replaced_without_a_gap(
    store, decoders, metadata, builtin_model, builtin_runner
):
    router = start_router(store, decoders)
    token = metadata.add_tenant("alice")
    prompt = documents(builtin_model, 1)[0]
    want = full_kv_tokens(builtin_runner, builtin_model, prompt, 24)
    first = owner(prompt, client_salt(store, token), decoders)
    victim = next(d for d in decoders if d.address == first)
    pieces, stopped = [], threading.Event()
    with DecoderClient(router.address, token) as client:
        reply = GenerateReply()
        for piece in client.stream(reply=reply, token_ids=prompt, max_new_tokens=24, mode="full"):
            pieces.append(piece.tokens)
            if not stopped.is_set() and len(reply.tokens) >= 3:
                stopped.set()
                victim.server.stop(0)  # its streams end at once, mid-request
    assert stopped.is_set() and reply.tokens == want
    assert sum(pieces, []) == want  # nothing duplicated or missing
    assert reply.stats["router"]["failovers"] == 1
    assert reply.stats["router"]["decoders"][0] == first != reply.stats["worker"]
    router.stop(0)


def test_a_burst_spills_and_a_new_decoder_gets_new_prefixes(
    store, decoders, metadata, builtin_model
):
    router = start_router(store, decoders[:1])
    token = metadata.add_tenant("alice")
    doc = documents(builtin_model, 1)[0]
    with DecoderClient(router.address, token) as client:
        assert client.generate(token_ids=doc, max_new_tokens=2).stats["worker"] == "decoder-0"
    router.set_decoders([d.address for d in decoders])  # decoder-1 joins
    salt = client_salt(store, token)
    docs = [
        d for d in documents(builtin_model, 48) if owner(d, salt, decoders) == decoders[1].address
    ]
    assert docs
    with DecoderClient(router.address, token) as client:
        assert client.generate(token_ids=docs[0], max_new_tokens=2).stats["worker"] == "decoder-1"
    replies, threads = [], []

    def one():
        with DecoderClient(router.address, token) as c:
            replies.append(c.generate(token_ids=doc, max_new_tokens=8, mode="full"))

    for _ in range(4):  # a burst over one prefix, all in flight at once
        threads.append(threading.Thread(target=one))
        threads[-1].start()
    for t in threads:
        t.join(300)
    assert len(replies) == 4 and len({r.stats["worker"] for r in replies}) == 2
    assert len({tuple(r.tokens) for r in replies}) == 1
    router.stop(0)


def test_auth_and_tenants_are_unchanged_through_the_router(store, decoders, metadata):
    router = start_router(store, decoders)
    alice = metadata.add_tenant("alice")
    with DecoderClient(router.address, "not-a-token") as client, pytest.raises(Unauthenticated):
        client.generate(token_ids=[1, 2, 3], max_new_tokens=1)
    with DecoderClient(router.address, alice) as client:
        with pytest.raises(NotFound):
            client.generate(token_ids=[1, 2, 3], max_new_tokens=1, namespace="bobs-docs")
        info = client.info()
    assert info.worker_id == "router-0" and info.model_id
    assert info.max_new_tokens == MAX_NEW_TOKENS  # the least of its decoders' bounds
    router.stop(0)


def test_a_router_stopped_fails_its_streams_unavailable(store, decoders, metadata, builtin_model):
    router = start_router(store, decoders)
    token = metadata.add_tenant("alice")
    prompt = documents(builtin_model, 1)[0]
    with DecoderClient(router.address, token, timeout_s=60) as client:
        stream = client.stream(token_ids=prompt, max_new_tokens=64, mode="full")
        next(stream)
        router.stop(0)
        with pytest.raises(Exception) as error:  # noqa: B017
            list(stream)
    assert "UNAVAILABLE" in repr(error.value) or "Unavailable" in type(error.value).__name__
    restarted = start_router(store, decoders)  # nothing to restore: it serves at once
    with DecoderClient(restarted.address, token) as client:
        assert client.generate(token_ids=prompt, max_new_tokens=2).tokens
    restarted.stop(0)


def client_salt(store, token) -> bytes:
    with store.client(token) as client:
        return client.topology.salts[""]
