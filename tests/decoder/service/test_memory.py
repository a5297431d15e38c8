"""What a decoder worker holds stays bounded (issue 15), through the real Decoder service
over a real store shard, Redis and the built-in model: a stream of distinct compressor
specs and prefixes leaves at most `max_engines` engines and `prefix_cache` cached prefixes,
every byte they hold is charged to the KV budget (and reclaimed when a request needs it), a
local prefill is charged before it runs, and every output equals full-KV decoding."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from decoder.service.client import DecoderClient
from tests.decoder.service.conftest import serve
from tests.references import full_kv_tokens

NEW = 4


def documents(model, count: int, tokens: int) -> list[list[int]]:
    text = inspect.getsource(textwrap)
    return [model.encode(f"# part {i}\n" + text[i * 400 :])[:tokens] for i in range(count)]


def reference(runner, model, prompt):
    return full_kv_tokens(runner, model, prompt, NEW)


def idle_charges(worker) -> int:
    """Budget bytes held by idle cached prefixes, as the decoder reports them."""
    return worker.info().kv_cached


def test_distinct_specs_and_prefixes_leave_bounded_state_all_charged(
    store, metadata, builtin_model, builtin_runner
):
    decoder = serve(store.endpoints, builtin_model, max_engines=2, prefix_cache=2)
    worker = decoder.worker
    docs = documents(builtin_model, 3, 260)
    question = builtin_model.encode("\n# Explain.\n")[1:]
    try:
        with DecoderClient(decoder.address, metadata.add_tenant("many")) as client:
            for doc in docs:
                client.publish(token_ids=doc, compressors=[])
            for i in range(6):
                spec = f"snapkv:budget=0.{10 + i}"  # a new spec, and a new engine, each time
                prompt = docs[i % 3] + question if i % 2 == 0 else docs[i % 3][: 40 + i]
                reply = client.generate(token_ids=prompt, max_new_tokens=NEW, compressor=spec)
                assert reply.tokens == reference(builtin_runner, builtin_model, prompt), spec
                info = worker.info()
                assert info.engines <= 2 and info.cached_prefixes <= 2
                # Nothing in flight: the budget holds exactly what the cache holds.
                assert worker.budget.used == idle_charges(worker) > 0
    finally:
        decoder.stop(0)


def test_a_tight_budget_reclaims_idle_prefixes_for_a_request(
    store, metadata, builtin_model, builtin_runner
):
    docs = documents(builtin_model, 2, 300)
    question = builtin_model.encode("\n# Explain.\n")[1:]
    settings = dict(prefix_cache=8, resident_prefixes=False)  # no opportunistic residents
    probe = serve(store.endpoints, builtin_model, **settings)
    try:
        with DecoderClient(probe.address, metadata.add_tenant("probe")) as client:
            client.publish(token_ids=docs[0], compressors=[])
            probe.worker.budget.peak = 0  # the publish's transient prefill is not counted
            client.generate(token_ids=docs[0] + question, max_new_tokens=NEW)
        one, idle = probe.worker.budget.peak, idle_charges(probe.worker)
    finally:
        probe.stop(0)
    limit = one + idle // 2  # one request (with its artifact), not another's idle artifact
    decoder = serve(store.endpoints, builtin_model, kv_budget=limit, **settings)
    try:
        with DecoderClient(decoder.address, metadata.add_tenant("tight")) as client:
            for doc in docs:
                client.publish(token_ids=doc, compressors=[])
                prompt = doc + question
                reply = client.generate(token_ids=prompt, max_new_tokens=NEW)
                assert reply.tokens == reference(builtin_runner, builtin_model, prompt)
        # The second request needed the first prefix's idle bytes: it was dropped for them.
        assert decoder.worker.info().cached_prefixes == 1
        assert decoder.worker.budget.used == idle_charges(decoder.worker)
    finally:
        decoder.stop(0)


def test_a_local_prefill_is_charged_before_it_runs(store, metadata, builtin_model):
    prompt = documents(builtin_model, 1, 200)[0]
    prompt_kv = (len(prompt) - 1) * builtin_model.config.kv_bytes_per_token
    decoder = serve(store.endpoints, builtin_model, kv_budget=prompt_kv // 2)
    try:
        client = DecoderClient(decoder.address, metadata.add_tenant("local"))
        with client, pytest.raises(Exception, match="the prompt's KV needs .* budget is"):
            client.generate(token_ids=prompt, max_new_tokens=NEW)
        assert decoder.worker.budget.peak == 0  # refused before any prefill
    finally:
        decoder.stop(0)
    decoder = serve(store.endpoints, builtin_model)
    try:
        with DecoderClient(decoder.address, metadata.add_tenant("local2")) as client:
            client.generate(token_ids=prompt, max_new_tokens=NEW)
        assert decoder.worker.budget.peak >= prompt_kv
        assert decoder.worker.budget.used == 0  # nothing cached: a local prefix is not kept
    finally:
        decoder.stop(0)


def test_a_decoder_builds_its_drafters_weights_before_any_request(store, builtin_model):
    """A decoder serving a caller's model holds its drafter's low-precision copy from the
    start, as one that loads its own model does (`load_runner(draft=True)`): no request's
    latency or measured draft step pays for building it (1.4-2.3 s for the built-in model)."""
    decoder = serve(store.endpoints, builtin_model)
    try:
        held = decoder.worker.info().weight_bytes
        assert decoder.worker.runner.draft_weight_bytes > 0
        assert held == decoder.worker.runner.weight_bytes  # counted in what it reports
    finally:
        decoder.stop(0)
