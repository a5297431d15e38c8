"""A router under hostile input: every method of its Decoder service, learned from its own
reflection, with garbage and wild messages from no, a wrong and a valid token, answers
with a precise status (never UNKNOWN or INTERNAL) and keeps routing afterwards."""

from __future__ import annotations

import pytest

from decoder.router import RouterConfig, RouterServer
from decoder.router.server import load_tokenizer
from decoder.service.client import DecoderClient
from prefix_store.config import ClientConfig
from prefix_store.errors import QuotaExceeded
from tests.decoder.service.conftest import serve
from tests.hostile import sweep
from tests.prefix_store.conftest import Store


def test_every_router_method_survives_hostile_input(
    metadata, redis_server, tmp_path, builtin_model
):
    store = Store(redis_server.url, tmp_path)
    store.start()
    decoder = serve(store.endpoints, builtin_model, worker_id="decoder-0")
    router = start_router(store, [decoder])
    token = metadata.add_tenant("hostile-router")
    try:
        assert sweep(router.address, "vericache.v1.Decoder", ["", "junk", token], count=4) == []
        with DecoderClient(router.address, token) as client:
            reply = client.generate(text="def add(a, b):", max_new_tokens=4)
            assert len(reply.tokens) == 4
    finally:
        router.stop(0)
        decoder.stop(0)
        store.close()


def test_decoders_over_budget_make_the_router_say_so_not_unavailable(
    metadata, redis_server, tmp_path, builtin_model
):
    """Every decoder refuses a prompt whose KV exceeds its budget: the caller hears the
    decoder's RESOURCE_EXHAUSTED (a limit, not retried), never UNAVAILABLE (try again)."""
    store = Store(redis_server.url, tmp_path)
    store.start()
    budget = 2048 * builtin_model.config.kv_bytes_per_token
    decoders = [
        serve(store.endpoints, builtin_model, worker_id=f"decoder-{i}", kv_budget=budget)
        for i in range(2)
    ]
    router = start_router(store, decoders)
    token = metadata.add_tenant("over-budget")
    try:
        with DecoderClient(router.address, token) as client:
            with pytest.raises(QuotaExceeded, match="budget"):
                client.generate(token_ids=list(range(100, 4100)), max_new_tokens=2, mode="full")
            assert len(client.generate(token_ids=[1, 2, 3], max_new_tokens=2).tokens) == 2
    finally:
        router.stop(0)
        for decoder in decoders:
            decoder.stop(0)
        store.close()


def start_router(store, decoders) -> RouterServer:
    config = RouterConfig(
        tuple(store.endpoints),
        decoders=tuple(d.address for d in decoders),
        client=ClientConfig(timeout_s=10, retries=2, backoff_s=0.05),
        poll_s=0.2,
    )
    router = RouterServer(config, tokenizer=load_tokenizer(None))
    router.start()
    return router
