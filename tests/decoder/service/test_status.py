"""Status codes of the Decoder service (issue 15), through the real gRPC service over a real
store shard, Redis and the built-in model on loopback: a valid compressor spec works whatever
the prefill observed; a stored artifact that is not one is rebuilt, not INTERNAL; a decoder
that is shutting down answers UNAVAILABLE (clients retry elsewhere); an unexpected failure is
INTERNAL with only a request id, logged with its traceback under that id."""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import re
import textwrap

import grpc
import pytest
from safetensors.torch import save
from vericache.v1 import decoder_pb2 as dpb
from vericache.v1 import decoder_pb2_grpc as dpb_grpc

from cluster.redis_server import RedisServer
from decoder.compressors import parse_compressor
from decoder.compressors.artifact import FORMAT, from_bytes, validate
from decoder.service.client import DecoderClient
from decoder.store_source import kv_layout
from prefix_store.errors import StoreError, Unavailable
from prefix_store.metadata import Metadata
from prefix_store.status import REQUEST_ID
from tests.decoder.service.conftest import serve
from tests.prefix_store.conftest import Store
from tests.references import full_kv_tokens

NEW = 8
SNAPKV_200 = "snapkv:window=200"  # wider than the 128 queries a local prefill observes
INTERNAL = r"internal error \(request id ([0-9a-f]{12})\); see the server log"


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    """This module's own Redis: its shard and decoder outlive a test, and the session's Redis
    is emptied for each test (`metadata`), their registrations and usage with it."""
    redis = RedisServer(tmp_path_factory.mktemp("status-redis")).start()
    yield redis
    redis.stop()


@pytest.fixture(scope="module")
def store(plane, tmp_path_factory):
    """One shard on loopback over the module's Redis."""
    store = Store(plane.url, tmp_path_factory.mktemp("status-store"))
    store.start()
    yield store
    store.close()


@pytest.fixture(scope="module")
def decoder(store, builtin_model):
    """The module's decoder, shared: its tests only call it, each as tenants of its own (the
    test that stops a decoder starts its own)."""
    server = serve(store.endpoints, builtin_model)
    yield server
    server.stop(0)


@pytest.fixture
def tenant(plane):
    """`tenant(name)`: the token of a new tenant, named after `name` and unique in the module's
    Redis (the module's tests share it)."""
    metadata = Metadata(plane.url)
    return lambda name: metadata.add_tenant(f"{name}-{next(_TENANTS)}")


_TENANTS = itertools.count()


def document(model, tokens: int) -> list[int]:
    return model.encode(inspect.getsource(textwrap))[:tokens]


def reference(runner, model, prompt: list[int]) -> list[int]:
    return full_kv_tokens(runner, model, prompt, NEW)


@pytest.mark.parametrize("tokens", [300, 40], ids=["window-inside-prompt", "prompt-shorter"])
def test_a_wide_window_on_an_uncached_prompt_decodes_exactly(
    tokens, decoder, tenant, builtin_model, builtin_runner
):
    prompt = document(builtin_model, tokens)
    with DecoderClient(decoder.address, tenant("window")) as client:
        reply = client.generate(token_ids=prompt, max_new_tokens=NEW, compressor=SNAPKV_200)
    assert reply.stats["cached_tokens"] == 0
    assert reply.tokens == reference(builtin_runner, builtin_model, prompt)


def test_a_wide_window_over_a_cached_prefix_decodes_exactly(
    decoder, tenant, builtin_model, builtin_runner
):
    doc = document(builtin_model, 300)
    prompt = doc + builtin_model.encode("\n# What does dedent do?\n")[1:]
    with DecoderClient(decoder.address, tenant("cached")) as client:
        client.publish(token_ids=doc, compressors=[])
        reply = client.generate(token_ids=prompt, max_new_tokens=NEW, compressor=SNAPKV_200)
    assert reply.stats["cached_tokens"] == len(doc)
    assert reply.tokens == reference(builtin_runner, builtin_model, prompt)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00" * 8,
        b"\x08\x00\x00\x00\x00\x00\x00\x00{}",
        save({}, metadata={"format": FORMAT}),
        save({}, metadata={"format": FORMAT, "header": "[" * 100_000}),
        b"not safetensors at all",
    ],
    ids=["zero-length-header", "no-metadata", "no-header", "header-nested-too-deep", "text"],
)
def test_a_stored_artifact_that_is_not_one_is_rebuilt(
    garbage, store, decoder, tenant, builtin_model, builtin_runner
):
    """Signed with the deployment's key (what a faulty decoder would store), so it is
    fetched and read when the request drafts: refused as ArtifactFormatError, rebuilt and
    stored in its place."""
    token = tenant("artifact")
    doc = document(builtin_model, 200)
    prompt = doc + builtin_model.encode("\n# Summarise.\n")[1:]
    spec = parse_compressor("snapkv:budget=0.25").spec
    layout = kv_layout(builtin_model.config, builtin_model.fingerprint)
    with DecoderClient(decoder.address, token) as client:
        client.publish(token_ids=doc, compressors=[])
    with store.client(token) as raw:
        cached = raw.lookup(doc, layout)
        raw.put_artifact(cached, spec, garbage, signer=decoder.worker.signer)
    with DecoderClient(decoder.address, token) as client:
        reply = client.generate(token_ids=prompt, max_new_tokens=NEW, compressor=spec, horizon=4)
    assert reply.tokens == reference(builtin_runner, builtin_model, prompt)
    with store.client(token) as raw:
        stored = raw.fetch_artifact(cached, spec, decoder.worker.signer.verifier)
    validate(from_bytes(stored), layout, len(doc), spec)


def test_a_decoder_shutting_down_answers_unavailable(store, tenant, builtin_model):
    decoder = serve(store.endpoints, builtin_model)  # its own: this test stops it
    token = tenant("late")
    doc = document(builtin_model, 40)
    try:
        with DecoderClient(decoder.address, token) as client:
            client.publish(token_ids=doc, compressors=[])
            decoder.worker.model_thread.stop()  # the worker stops before its server does
            with pytest.raises(Unavailable, match="shutting down"):  # a local prefill
                client.generate(token_ids=document(builtin_model, 30), max_new_tokens=NEW)
            with pytest.raises(Unavailable, match="shutting down"):  # an engine submission
                client.generate(token_ids=doc + [13], max_new_tokens=NEW, mode="full")
            with pytest.raises(Unavailable, match="shutting down"):
                client.publish(token_ids=doc[:20])
    finally:
        decoder.stop(0)


def _secret(*args, **kwargs):
    raise RuntimeError("secret-detail at /etc/vericache/key.pem")


@pytest.mark.parametrize("method", ["Info", "Generate"])
def test_an_unexpected_failure_is_internal_with_only_a_request_id(
    method, decoder, tenant, monkeypatch, caplog
):
    """The caller learns a request id and nothing else; the log has the id and the
    traceback (exception text included)."""
    monkeypatch.setattr(decoder.worker, method.lower(), _secret)
    token = tenant("unlucky")
    caplog.set_level(logging.ERROR)
    with DecoderClient(decoder.address, token) as client, pytest.raises(StoreError) as failed:
        client.info() if method == "Info" else client.generate(text="def f():", max_new_tokens=2)
    message = str(failed.value)
    found = re.fullmatch(INTERNAL, message)
    assert found, message
    assert "secret" not in message and "/etc" not in message
    records = [r for r in caplog.records if found[1] in r.getMessage()]
    assert len(records) == 1 and f"Decoder.{method}" in records[0].getMessage()
    assert records[0].exc_info is not None and records[0].exc_info[0] is RuntimeError
    assert "secret-detail" in caplog.text and "Traceback" in caplog.text


def test_an_internal_failure_names_its_request_id_in_trailing_metadata(
    decoder, tenant, monkeypatch
):
    monkeypatch.setattr(decoder.worker, "info", _secret)
    auth = (("authorization", f"Bearer {tenant('traced')}"),)
    with grpc.insecure_channel(decoder.address) as channel, pytest.raises(grpc.RpcError) as failed:
        dpb_grpc.DecoderStub(channel).Info(dpb.InfoRequest(), metadata=auth, timeout=20)
    error = failed.value
    assert error.code() == grpc.StatusCode.INTERNAL
    assert re.fullmatch(INTERNAL, error.details())
    assert dict(error.trailing_metadata())[REQUEST_ID] in error.details()


@pytest.mark.parametrize(
    "sampling, named",
    [
        ({"temperature": 0.8, "top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"temperature": 0.8, "top_p": -0.25}, "top_p must be in (0, 1], got -0.25"),
        ({"temperature": 0.8, "top_p": math.nan}, "top_p must be in (0, 1], got nan"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": math.nan}, "temperature must be >= 0, got nan"),
    ],
)
def test_sampling_out_of_range_is_invalid_argument_naming_the_field(
    decoder, tenant, sampling, named
):
    """Not quietly treated as off: the caller asked for something this decoder won't do."""
    request = dpb.GenerateRequest(
        token_ids=dpb.TokenIds(ids=[5, 6, 7]), max_new_tokens=2, sampling=dpb.Sampling(**sampling)
    )
    token = tenant("sampler")
    with grpc.insecure_channel(decoder.address) as channel:
        call = channel.unary_stream(
            f"/{dpb.DESCRIPTOR.services_by_name['Decoder'].full_name}/Generate",
            request_serializer=dpb.GenerateRequest.SerializeToString,
            response_deserializer=dpb.GenerateEvent.FromString,
        )
        with pytest.raises(grpc.RpcError) as raised:
            list(call(request, metadata=(("authorization", f"Bearer {token}"),), timeout=30))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == f"sampling: {named}"


@pytest.mark.parametrize("mode", ["vericache", "full"])
def test_a_prefix_deleted_between_lookup_and_reads_is_recomputed_exactly(
    mode, decoder, store, tenant, builtin_model, builtin_runner
):
    """The seam: the caller's store client answers the lookup, then the prefix's chunks are
    deleted before any read (an eviction race). The request is served, token for token as
    full-KV decoding, never NOT_FOUND."""
    token = tenant("racer")
    prompt = document(builtin_model, 120)
    with DecoderClient(decoder.address, token) as client:
        client.publish(token_ids=prompt[:-1], compressors=[])
        worker = decoder.worker
        caller = worker.client(token)
        lookup = caller.lookup

        def lookup_then_delete(tokens, layout, namespace=""):
            found = lookup(tokens, layout, namespace)
            with store.client(token) as other:
                assert other.delete_prefix(tokens, layout, namespace) > 0
            return found

        caller.lookup = lookup_then_delete  # this test's seam, on this caller's client only
        try:
            reply = client.generate(token_ids=prompt, max_new_tokens=NEW, mode=mode)
        finally:
            del caller.lookup
    assert reply.stats["cached_tokens"] > 0  # it was found, then lost
    assert reply.tokens == reference(builtin_runner, builtin_model, prompt)
