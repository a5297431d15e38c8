"""The engine over the remote prefix store: a prefix published to real shards (gRPC on
loopback, real Redis) and read back layer by layer decodes exactly as full-KV decoding."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from decoder.engine import Engine, EngineConfig, Prefix, Request, prefill_prefix
from decoder.sampling import SamplingParams
from decoder.store_source import StoreKVSource, kv_layout, publish_source
from tests.prefix_store.conftest import Store
from tests.references import full_kv_tokens

NEW_TOKENS = 24


@pytest.fixture
def shards(redis_server, metadata, tmp_path):
    store = Store(redis_server.url, tmp_path)
    store.start("shard-0")
    store.start("shard-1")
    yield store
    store.close()


@pytest.mark.parametrize(
    "mode, sampling",
    [
        ("vericache", None),
        ("vericache", SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3)),
        ("full", None),
    ],
)
def test_decoding_over_the_store_is_token_for_token_full_kv(
    mode, sampling, builtin_model, builtin_runner, shards, metadata
):
    prompt = builtin_model.encode(inspect.getsource(textwrap))[:700]
    local = prefill_prefix(builtin_runner, prompt[:-9], observe=128)
    want = full_kv_tokens(builtin_runner, builtin_model, prompt, NEW_TOKENS, sampling)
    token = metadata.add_tenant("decoder")
    layout = kv_layout(builtin_model.config, builtin_model.fingerprint)
    with shards.client(token) as client:
        publish_source(client, local.tokens, local.source, layout)
        cached = client.lookup(prompt, layout)
        assert cached.tokens == len(local.tokens)  # 691 tokens: 2 full chunks + a partial one
        source = StoreKVSource(client, cached)
        remote = Prefix(local.tokens, source, local.observed)
        engine = Engine(
            builtin_runner,
            EngineConfig(mode=mode, horizon=6),
            builtin_model.eos_token_ids,
        )
        request = Request(remote, prompt[cached.tokens :], NEW_TOKENS, sampling or SamplingParams())
        got = engine.run([request])[0].tokens
    assert got == want
    assert source.bytes_read >= cached.bytes  # the full KV really came from the shards
