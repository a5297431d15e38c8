"""A malformed artifact fails nobody: real Ray actors (shards and one decoder), a real
Redis, gRPC on loopback and the built-in model.

An artifact that does not fit the model (zero layers, or half the head dim) is stored for a
tenant's prefix through the SDK: as the tenant (unsigned: the decoder does not even fetch
it), or signed with the deployment's key (what a faulty decoder build would store; the
decoder fetches it and `validate` refuses it). Either way the tenant's requests over that
prefix are served as on a miss (the artifact is rebuilt from the full KV and stored in its
place) and equal in-process full-KV decoding; another tenant's request decoding at the same
time on the same decoder, in the same engine, equals full-KV decoding too."""

from __future__ import annotations

import inspect
import json.decoder
import textwrap
import threading

import pytest
import torch

from decoder.compressors import CompressedKV, DenseLayer, parse_compressor
from decoder.compressors.artifact import from_bytes, to_bytes, validate
from decoder.service.client import DecoderClient, GenerateReply
from decoder.store_source import kv_layout
from prefix_store.client import StoreClient
from tests.references import full_kv_tokens

pytestmark = pytest.mark.cluster

NEW = 24
LONG = 64  # the other tenant's request: still decoding while the first one runs


@pytest.fixture(scope="module")
def tenants(service):
    from prefix_store.metadata import Metadata

    md = Metadata(service.redis_url)
    return {name: md.add_tenant(f"isolation-{name}", 0) for name in ("a", "b")}


@pytest.fixture(scope="module")
def prompts(builtin_model):
    """(document, prompt) per tenant."""
    out = {}
    for name, module, question in (
        ("a", textwrap, "\n# What does dedent do?\n"),
        ("b", json.decoder, "\n# What does scanstring do?\n"),
    ):
        doc = builtin_model.encode(inspect.getsource(module))[:500]
        out[name] = (doc, doc + builtin_model.encode(question)[1:])
    return out


@pytest.fixture(scope="module")
def published(service, tenants, prompts):
    """Each tenant's document is cached (its full KV only: no artifact yet)."""
    for name in ("a", "b"):
        with DecoderClient(service.decoders[0], tenants[name]) as client:
            client.publish(token_ids=prompts[name][0])
    return prompts


def _zero_layers(spec: str, tokens: int, model) -> CompressedKV:
    return CompressedKV(spec, tokens, [], 0)


def _half_head_dim(spec: str, tokens: int, model) -> CompressedKV:
    c = model.config
    kv, dim, kept = c.num_kv_heads, c.head_dim // 2, min(tokens, 16)
    positions = torch.arange(kept, dtype=torch.int32).expand(kv, -1)
    layers = [
        DenseLayer(torch.zeros(kv, kept, dim), torch.zeros(kv, kept, dim), positions)
        for _ in range(c.num_layers)
    ]
    return CompressedKV(spec, tokens, layers, 0)


@pytest.mark.parametrize(
    ("spec", "malformed", "signed"),
    [
        ("snapkv:budget=0.125", _zero_layers, False),
        ("kivi:bits=4", _zero_layers, True),
        ("streamingllm:sink=4,window=60", _half_head_dim, True),
    ],
    ids=["zero-layers-by-a-tenant", "zero-layers-signed", "half-head-dim-signed"],
)
def test_a_malformed_artifact_fails_no_request(
    spec, malformed, signed, service, tenants, published, builtin_model, builtin_runner
):
    spec = parse_compressor(spec).spec
    doc, prompt = published["a"]
    layout = kv_layout(builtin_model.config, builtin_model.fingerprint)
    endpoints = list(service.endpoints.values())
    with StoreClient(endpoints, tenants["a"]) as store:
        cached = store.lookup(doc, layout)
        assert cached.tokens == len(doc)
        data = to_bytes(malformed(spec, len(doc), builtin_model))
        store.put_artifact(cached, spec, data, signer=service.signer if signed else None)

    other, errors, decoding = GenerateReply(), [], threading.Event()

    def tenant_b() -> None:
        try:
            with DecoderClient(service.decoders[0], tenants["b"]) as client:
                kwargs = {"token_ids": published["b"][1], "max_new_tokens": LONG}
                for _ in client.stream(reply=other, compressor=spec, **kwargs):
                    decoding.set()
        except Exception as error:  # reported below
            errors.append(error)
        finally:
            decoding.set()

    thread = threading.Thread(target=tenant_b)
    thread.start()
    assert decoding.wait(timeout=600)
    with DecoderClient(service.decoders[0], tenants["a"]) as client:
        replies = [client.generate(token_ids=prompt, max_new_tokens=NEW, compressor=spec)]
        replies.append(client.generate(token_ids=prompt, max_new_tokens=NEW, compressor=spec))
    thread.join(timeout=600)
    assert not errors, errors
    want = full_kv_tokens(builtin_runner, builtin_model, prompt, NEW)
    for reply in replies:  # the first rebuilt the artifact; the second used the rebuilt one
        assert reply.tokens == want
        assert reply.stats["cached_tokens"] == len(doc) and reply.stats["verifications"] >= 1
    assert other.tokens == full_kv_tokens(builtin_runner, builtin_model, published["b"][1], LONG)
    # The rebuilt artifact replaced the malformed one in the store, for every worker.
    with StoreClient(endpoints, tenants["a"]) as store:
        stored = from_bytes(store.fetch_artifact(store.lookup(doc, layout), spec))
        validate(stored, layout, len(doc), spec)
