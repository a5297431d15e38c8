"""Near-data verification through the Decoder service (real gRPC, real shards, Redis and the
built-in model): decoders placed `near` with no resident copies verify every pass against
attention partials the shards compute; every reply equals in-process full-KV decoding, for
private and shared-namespace prefixes, two tenants, greedy and seeded sampling."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from decoder.sampling import SamplingParams
from decoder.service.client import DecoderClient
from tests.decoder.service.conftest import serve
from tests.prefix_store.conftest import Store
from tests.references import full_kv_tokens

pytestmark = pytest.mark.fused_kernel  # skips only where the CPU cannot run it

NEW = 16


@pytest.fixture
def shards(redis_server, metadata, tmp_path):
    metadata.set_replication(2)
    store = Store(redis_server.url, tmp_path)
    for i in range(2):
        store.start(f"shard-{i}")
    yield store
    store.close()


def reference(runner, model, prompt, sampling=None):
    return full_kv_tokens(runner, model, prompt, NEW, sampling)


def test_near_data_replies_equal_full_kv_for_tenants_and_namespaces(
    shards, metadata, builtin_model, builtin_runner
):
    doc = builtin_model.encode(inspect.getsource(textwrap))[:650]  # 2 full chunks + 138
    question = builtin_model.encode("\n# What does this module do?\n")[1:]
    prompt = doc + question
    alice, bob = metadata.add_tenant("alice"), metadata.add_tenant("bob")
    metadata.add_shared("docs", members=["alice"], readers=["bob"])
    decoder = serve(shards.endpoints, builtin_model, placement="near", resident_prefixes=False)
    sampled = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 11}
    want_greedy = reference(builtin_runner, builtin_model, prompt)
    want_sampled = reference(builtin_runner, builtin_model, prompt, SamplingParams(**sampled))
    replies = []
    try:
        with DecoderClient(decoder.address, alice) as client:
            client.publish(token_ids=doc, compressors=["snapkv:budget=0.125"])
            client.publish(token_ids=doc, namespace="docs", compressors=["kivi:bits=2"])
            replies.append((client.generate(token_ids=prompt, max_new_tokens=NEW), want_greedy))
            reply = client.generate(
                token_ids=prompt, max_new_tokens=NEW, compressor="kivi:bits=2", **sampled
            )
            replies.append((reply, want_sampled))
        with DecoderClient(decoder.address, bob) as client:
            reply = client.generate(
                token_ids=prompt, max_new_tokens=NEW, namespace="docs", compressor="kivi:bits=2"
            )
            replies.append((reply, want_greedy))
    finally:
        decoder.stop(0)
    for reply, want in replies:
        assert reply.tokens == want
        stats = reply.stats
        assert stats["cached_tokens"] == len(doc) and stats["near_passes"] > 0
        # only the prefix's last, partial chunk was pulled (once)
        assert stats["pulled_bytes"] <= stats["full_bytes"] * 256 / stats["prefix_tokens"]
