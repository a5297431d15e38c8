"""The Decoder under hostile callers: concurrent calls bounded per tenant (over the limit:
RESOURCE_EXHAUSTED naming it, other tenants unaffected), and a reflection-driven sweep of
garbage and wild messages over every method that never ends UNKNOWN or INTERNAL and
leaves the decoder serving. Real store shard, Redis and the built-in model on loopback."""

from __future__ import annotations

import threading
import time
import tracemalloc

import grpc
import pytest
from vericache.v1 import decoder_pb2 as dpb

from decoder.compressors import parse_compressor
from decoder.engine import prefill_prefix
from decoder.generate import generate_full
from decoder.service.client import DecoderClient
from decoder.service.server import prompt_ids
from decoder.service.status import BadRequest
from decoder.store_source import kv_layout, publish_source
from prefix_store.errors import InvalidArgument
from prefix_store.limits import CallBounds
from tests.decoder.service.conftest import serve
from tests.hostile import sweep


def test_a_tenant_over_its_call_limit_is_told_so_and_others_are_served(
    store, metadata, builtin_model
):
    decoder = serve(store.endpoints, builtin_model, calls=CallBounds(per_tenant=1, total=2))
    busy, other = metadata.add_tenant("busy"), metadata.add_tenant("other")
    try:
        with DecoderClient(decoder.address, busy) as client:
            stream = client.stream(text="def fibonacci(n):", max_new_tokens=64)
            next(stream)  # the first call holds the tenant's only slot while it streams
            # Refused as busy: the SDK tries again until its deadline, then says why.
            impatient = DecoderClient(decoder.address, busy, timeout_s=1.5)
            with impatient, pytest.raises(Exception) as refused:
                impatient.info()
            assert "per-tenant limit 1" in str(refused.value)
            with DecoderClient(decoder.address, other) as neighbour:
                assert neighbour.info().worker_id == decoder.config.worker_id
            # A patient caller is served as soon as the slot is free.
            waited = []
            waiting = threading.Thread(target=lambda: waited.append(client.info().worker_id))
            waiting.start()
            time.sleep(0.5)
            assert not waited  # still refused, and retrying
            stream.close()
            waiting.join(30)
            assert waited == [decoder.config.worker_id]
    finally:
        decoder.stop(0)


def test_every_method_survives_hostile_input(store, metadata, builtin_model):
    decoder = serve(store.endpoints, builtin_model)
    token = metadata.add_tenant("hostile")
    try:
        assert sweep(decoder.address, "vericache.v1.Decoder", ["", "junk", token], count=4) == []
        with DecoderClient(decoder.address, token) as client:
            reply = client.generate(text="def add(a, b):", max_new_tokens=4)
            assert len(reply.tokens) == 4
        with grpc.insecure_channel(decoder.address) as channel:
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        decoder.stop(0)


def test_prompts_that_cannot_fit_the_context_are_refused_before_work(
    store, metadata, builtin_model
):
    decoder = serve(store.endpoints, builtin_model)
    token = metadata.add_tenant("long")
    limit = builtin_model.config.max_position_embeddings
    try:
        with DecoderClient(decoder.address, token) as client:
            with pytest.raises(InvalidArgument, match=f"context of {limit}"):
                client.publish(token_ids=[13] * (limit + 1))
            started = time.monotonic()
            with pytest.raises(InvalidArgument, match=f"context of {limit} tokens"):
                client.publish(text="word " * (limit * 100))
            assert time.monotonic() - started < 5  # refused before tokenizing
        huge = dpb.PublishRequest(token_ids=dpb.TokenIds(ids=[13] * 2_000_000))
        tracemalloc.start()
        try:
            with pytest.raises(BadRequest, match="2000000 tokens exceed"):
                prompt_ids(huge, decoder.worker)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20  # counted, not copied into a list (that is ~16 MB and up)
    finally:
        decoder.stop(0)


def test_a_tenant_may_opt_in_to_its_own_unsigned_kv_in_its_private_namespace(
    store, metadata, builtin_model, builtin_runner
):
    """Raw SDK puts are unsigned: decoders recompute them, unless their owner explicitly
    asks to verify against them (its private namespace only)."""
    decoder = serve(store.endpoints, builtin_model)
    token = metadata.add_tenant("own")
    metadata.add_shared("docs", ["own"])
    doc = builtin_model.encode("def add(a, b):\n    return a + b\n" * 20)
    prompt = doc + builtin_model.encode("# add(2, 3) is")[1:]
    want = generate_full(
        builtin_runner, [prompt], max_new_tokens=8, eos_token_ids=builtin_model.eos_token_ids
    )[0].tokens
    layout = kv_layout(builtin_model.config, builtin_model.fingerprint)
    with store.client(token) as raw:  # the exact KV, stored without a decoder's signature
        publish_source(raw, doc, prefill_prefix(builtin_runner, doc, 1).source, layout)
    try:
        with DecoderClient(decoder.address, token) as client:
            default = client.generate(token_ids=prompt, max_new_tokens=8)
            assert default.stats["cached_tokens"] == 0 and default.tokens == want
            own = client.generate(  # it drafts (horizon 4): its artifact is built then
                token_ids=prompt, max_new_tokens=8, use_unsigned_prefix=True, horizon=4
            )
            assert own.stats["cached_tokens"] == len(doc) and own.tokens == want
        with store.client(token) as raw:  # the artifact built from it is not signed either
            cached = raw.lookup(doc, layout)
            spec = parse_compressor(decoder.config.default_compressor).spec
            assert raw.fetch_artifact(cached, spec) is not None
            assert raw.fetch_artifact(cached, spec, decoder.worker.signer.verifier) is None
        with (
            DecoderClient(decoder.address, token) as client,
            pytest.raises(InvalidArgument, match="private namespace"),
        ):
            client.generate(
                token_ids=prompt, max_new_tokens=8, namespace="docs", use_unsigned_prefix=True
            )
    finally:
        decoder.stop(0)
