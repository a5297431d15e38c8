"""A decoder's Prometheus endpoint and its shadow identity check, over real gRPC, a real
shard and Redis and the built-in model: counters after a small workload, every audit of a
normal run identical, a deliberately injected mismatch found and counted."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decoder.service.client import DecoderClient
from prefix_store.errors import InvalidArgument
from prefix_store.metrics import MetricsConfig, scrape
from tests.decoder.service.conftest import serve

SECRET = "decoder-metrics-token"
NEW = 8


def samples(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def audits(got: dict, result: str) -> float:
    return got[("vericache_decoder_audits_total", ("result", result))]


@pytest.fixture
def decoder(store, builtin_model):
    server = serve(
        store.endpoints,
        builtin_model,
        metrics=MetricsConfig(port=0, token=SECRET),
        audit_rate=1.0,
        kv_budget=1 << 30,
    )
    yield server
    server.stop(grace_s=0)


REASONS = ("fixed", "start", "draft", "exact", "probe")


def test_metrics_and_audits_after_a_small_workload(decoder, metadata, builtin_model, caplog):
    token = metadata.add_tenant("alice")
    doc = builtin_model.encode("def fibonacci(n):\n    " * 40)[:300]
    prompt = doc + builtin_model.encode("\n# and now")[1:]
    with DecoderClient(decoder.address, token) as client:
        client.publish(token_ids=doc, compressors=["snapkv:budget=0.25"])
        greedy = client.generate(token_ids=prompt, max_new_tokens=NEW, mode="vericache")
        sampled = client.generate(
            token_ids=prompt, max_new_tokens=NEW, mode="vericache", temperature=0.9, top_k=20
        )  # unseeded: the audit replays the seed it was given
        client.generate(token_ids=prompt, max_new_tokens=NEW, mode="lossy")  # never audited
        with pytest.raises(InvalidArgument):
            client.generate(token_ids=prompt, max_new_tokens=NEW, mode="nonsense")
    assert decoder.worker.auditor.wait(300)
    got = samples(scrape(decoder.metrics_url, SECRET))
    assert audits(got, "identical") == 2 and audits(got, "mismatch") == 0
    tokens = (
        "vericache_decoder_generated_tokens_total",
        ("mode", "vericache"),
        ("tenant", "alice"),
    )
    assert got[tokens] == len(greedy.tokens) + len(sampled.tokens)
    ok = ("vericache_decoder_requests_total", ("code", "OK"), ("method", "Generate"))
    bad = ("vericache_decoder_requests_total", ("code", "INVALID_ARGUMENT"), ("method", "Generate"))
    assert got[ok] == 3 and got[bad] == 1
    verifications = greedy.stats["verifications"] + sampled.stats["verifications"]
    assert got[("vericache_decoder_accepted_per_verification_count",)] == verifications
    rounds = {r: got[("vericache_decoder_rounds_total", ("reason", r))] for r in REASONS}
    assert sum(rounds.values()) == verifications and rounds["start"] >= 1
    for reply in (greedy, sampled):  # every round's horizon says why it was chosen
        assert sum(reply.stats["policy"].values()) == reply.stats["verifications"]
    assert got[("vericache_decoder_near_retries_total",)] == 0  # no pass was redone
    assert got[("vericache_decoder_kv_budget_bytes",)] == 1 << 30
    assert got[("vericache_decoder_tokens_per_second",)] > 0
    assert greedy.stats["request_id"] != sampled.stats["request_id"]

    decoder.worker.auditor.tamper = lambda reference: reference[:-1] + [reference[-1] + 1]
    with (
        caplog.at_level(logging.ERROR, logger="decoder.service.audit"),
        DecoderClient(decoder.address, token) as client,
    ):
        tampered = client.generate(token_ids=prompt, max_new_tokens=NEW, mode="vericache")
        assert decoder.worker.auditor.wait(300)
    got = samples(scrape(decoder.metrics_url, SECRET))
    assert audits(got, "mismatch") == 1 and audits(got, "identical") == 2
    logged = [r.getMessage() for r in caplog.records if "audit" in r.getMessage()]
    assert any(tampered.stats["request_id"] in line for line in logged)
    assert all(token not in line for line in logged)
