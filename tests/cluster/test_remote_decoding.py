"""Remote prefix caching end to end: real Ray actors (shards and a decoder worker), a real
Redis, gRPC on loopback and the built-in model. Every remote output is compared token for
token with in-process full-KV decoding of the same prompt."""

from __future__ import annotations

import inspect
import json
import textwrap
import threading

import pytest
import torch

from cluster.cli import main
from decoder.sampling import SamplingParams
from decoder.service.client import DecoderClient
from prefix_store.client import StoreClient
from prefix_store.errors import InvalidArgument, NotFound, Unauthenticated
from tests.references import full_kv_batch, full_kv_tokens
from tests.waiting import eventually

pytestmark = pytest.mark.cluster

NEW = 24
HORIZON = 8
"""A fixed horizon where pulls are compared: the automatic one adapts to measured costs,
which differ between solo and batched runs (a batch under load once verified more often)."""
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 77}


@pytest.fixture(scope="module")
def tenants(service):
    from prefix_store.metadata import Metadata

    md = Metadata(service.redis_url)
    tokens = {name: md.add_tenant(f"remote-{name}", 0) for name in ("a", "b", "c")}
    md.add_shared("docs", ["remote-a", "remote-b"])
    return tokens


@pytest.fixture(scope="module")
def document(builtin_model):
    """A ~700-token source file: the shared document prefix."""
    return builtin_model.decode(builtin_model.encode(inspect.getsource(textwrap))[:700])


def canonical(spec: str) -> str:
    from decoder.compressors import parse_compressor

    return parse_compressor(spec).spec


def decoder(service, token) -> DecoderClient:
    return DecoderClient(service.decoders[0], token)


def reference(builtin_runner, builtin_model, ids, sampling=None):
    """In-process full-KV decoding of `ids` (NEW tokens; `sampling`: SamplingParams fields)."""
    sampler = SamplingParams(**(sampling or {}))
    return full_kv_tokens(builtin_runner, builtin_model, ids, NEW, sampler)


def test_publish_then_remote_vericache_equals_full_kv(
    service, tenants, document, builtin_model, builtin_runner
):
    doc_ids = builtin_model.encode(document)
    with decoder(service, tenants["a"]) as client:
        published = client.publish(
            token_ids=doc_ids, compressors=["snapkv:budget=0.125", "kivi:bits=4"]
        )
        assert published.tokens == len(doc_ids)
        assert list(published.artifacts) == [
            canonical("snapkv:budget=0.125"),
            canonical("kivi:bits=4"),
        ]
        question = builtin_model.encode("\n# Question: what does dedent do?\n")[1:]
        prompt = doc_ids + question
        cases = [
            ("snapkv:budget=0.125", None, None),
            ("kivi:bits=4", SAMPLED, 6),  # with prompt-lookup guesses checked by the drafter
            ("streamingllm:sink=4,window=60", None, None),  # no artifact yet: built, stored
        ]
        for spec, sampling, ngram in cases:
            reply = client.generate(
                token_ids=prompt,
                max_new_tokens=NEW,
                compressor=spec,
                ngram=ngram,
                **(sampling or {}),
            )
            want = reference(builtin_runner, builtin_model, prompt, sampling)
            assert reply.tokens == want, spec
            assert reply.stats["cached_tokens"] == len(doc_ids)
            assert reply.stats["verifications"] >= 1
            assert reply.text == builtin_model.decode(want)
            assert ("ngram_proposed" in reply.stats) == bool(ngram)
        for ngram in (None, 6):
            full = client.generate(token_ids=prompt, max_new_tokens=NEW, mode="full", ngram=ngram)
            assert full.tokens == reference(builtin_runner, builtin_model, prompt)
    # The artifact the decoder built is in the store now, for every later worker.
    with StoreClient(list(service.endpoints.values()), tenants["a"]) as store:
        from decoder.store_source import kv_layout

        layout = kv_layout(builtin_model.config, builtin_model.fingerprint)
        cached = store.lookup(doc_ids, layout)
        assert cached.tokens == len(doc_ids)
        built = canonical("streamingllm:sink=4,window=60")
        assert store.fetch_artifact(cached, built) is not None


def test_shared_namespace_concurrent_tenants_batch_equals_solo(
    service, tenants, document, builtin_model, builtin_runner
):
    doc_ids = builtin_model.encode(document)
    with decoder(service, tenants["a"]) as client:
        client.publish(token_ids=doc_ids, namespace="docs", compressors=["snapkv:budget=0.125"])
    questions = ["Summarise it.", "What is fill?", "Name two functions.", "Explain wrap."]
    prompts = [doc_ids + builtin_model.encode(f"\n# {q}\n")[1:] for q in questions]
    solo = []
    with decoder(service, tenants["b"]) as client:
        for p in prompts:
            solo.append(client.generate(token_ids=p, max_new_tokens=NEW, namespace="docs",
                                        horizon=HORIZON))  # fmt: skip
    replies: list = [None] * len(prompts)

    def run(i: int) -> None:
        token = tenants["a"] if i % 2 else tenants["b"]
        with decoder(service, token) as client:
            replies[i] = client.generate(token_ids=prompts[i], max_new_tokens=NEW,
                                         namespace="docs", horizon=HORIZON)  # fmt: skip

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wants = full_kv_batch(builtin_runner, builtin_model, prompts, NEW)
    for i, want in enumerate(wants):
        assert solo[i].tokens == want and replies[i].tokens == want
        assert replies[i].stats["cached_tokens"] == len(doc_ids)
    # One pulled copy served requests verifying together: less pulled than solo runs.
    assert sum(r.stats["pulled_bytes"] for r in replies) < sum(
        r.stats["pulled_bytes"] for r in solo
    )


def test_isolation_private_and_shared_prefixes(
    service, tenants, document, builtin_model, builtin_runner
):
    ids = builtin_model.encode("A private preamble. " + document)
    with decoder(service, tenants["a"]) as client:
        client.publish(token_ids=ids[:400])
        own = client.generate(token_ids=ids[:420], max_new_tokens=8)
        assert own.stats["cached_tokens"] == 400
    want = reference(builtin_runner, builtin_model, ids[:420])[:8]
    assert own.tokens == want
    with decoder(service, tenants["b"]) as client:  # A's private prefix: a miss for B
        other = client.generate(token_ids=ids[:420], max_new_tokens=8)
        assert other.stats["cached_tokens"] == 0 and other.tokens == want
    doc_ids = builtin_model.encode(document)
    with decoder(service, tenants["c"]) as client:  # not a member: as if "docs" did not exist
        for namespace in ("docs", "no-such-namespace"):
            with pytest.raises(NotFound, match=f"namespace '{namespace}' not found"):
                client.generate(token_ids=doc_ids + [13], max_new_tokens=4, namespace=namespace)
        outsider = client.generate(token_ids=doc_ids + [13], max_new_tokens=4)
        assert outsider.stats["cached_tokens"] == 0
    with decoder(service, tenants["b"]) as client:
        member = client.generate(token_ids=doc_ids + [13], max_new_tokens=4, namespace="docs")
        assert member.stats["cached_tokens"] == len(doc_ids)
    assert member.tokens == outsider.tokens


def test_a_members_forged_kv_cannot_change_another_members_output(
    service, tenants, builtin_model, builtin_runner
):
    """A hostile member of a shared namespace stores random KV for a document through the
    SDK (a raw, unsigned put): another member's output over that document still equals
    full-KV decoding (the forged chunks are recomputed, never verified against). A put
    signed with a key of the attacker's own is refused. A member's publish through a
    decoder replaces the forged chunks, and later raw puts cannot displace them."""
    from decoder.store_source import kv_layout
    from prefix_store.provenance import Signer

    doc_ids = builtin_model.encode(inspect.getsource(json.decoder))[:600]
    prompt = doc_ids + builtin_model.encode("\n# What does scanstring do?\n")[1:]
    want = reference(builtin_runner, builtin_model, prompt)
    layout = kv_layout(builtin_model.config, builtin_model.fingerprint)
    shape = (layout.num_layers, 2, layout.num_kv_heads, len(doc_ids), layout.head_dim)
    forged = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    endpoints = list(service.endpoints.values())
    with StoreClient(endpoints, tenants["b"]) as attacker:
        attacker.publish_prefix(doc_ids, forged, layout, namespace="docs")
        assert attacker.lookup(doc_ids, layout, "docs").tokens == len(doc_ids)
        with pytest.raises(InvalidArgument, match="signature does not verify"):
            attacker.publish_prefix(doc_ids, forged, layout, "docs", signer=Signer.generate())
    with decoder(service, tenants["a"]) as client:
        reply = client.generate(token_ids=prompt, max_new_tokens=NEW, namespace="docs")
        assert reply.tokens == want
        assert reply.stats["cached_tokens"] == 0  # the forged KV was not used
        client.publish(token_ids=doc_ids, namespace="docs", compressors=["snapkv:budget=0.125"])
    with StoreClient(endpoints, tenants["b"]) as attacker:
        attacker.publish_prefix(doc_ids, forged, layout, namespace="docs")  # changes nothing
    with decoder(service, tenants["b"]) as client:
        reply = client.generate(token_ids=prompt, max_new_tokens=NEW, namespace="docs")
        assert reply.tokens == want
        assert reply.stats["cached_tokens"] == len(doc_ids)


def test_a_caller_that_goes_away_frees_the_decoder(service, tenants, document, builtin_model):
    with decoder(service, tenants["a"]) as client:
        stream = client.stream(token_ids=builtin_model.encode(document) + [13], max_new_tokens=400)
        next(stream)
        stream.close()  # cancels the call
        assert eventually(lambda: not client.info().in_flight, timeout_s=60, every_s=0.2)
        info = client.info()
        assert info.in_flight == 0 and info.queued == 0
        assert info.kv_used == info.kv_cached  # only the idle cached prefix is left


def test_bad_requests_get_precise_errors(service, tenants):
    with decoder(service, "not-a-token") as client, pytest.raises(Unauthenticated):
        client.generate(text="hello there", max_new_tokens=4)
    with decoder(service, tenants["a"]) as client:
        with pytest.raises(InvalidArgument, match="compressor|unknown"):
            client.generate(text="hello there", max_new_tokens=4, compressor="zip:level=9")
        with pytest.raises(InvalidArgument, match="max_new_tokens"):
            client.generate(text="hello there", max_new_tokens=0)
        with pytest.raises(InvalidArgument, match="mode"):
            client.generate(text="hello there", max_new_tokens=4, mode="turbo")
        with pytest.raises(InvalidArgument, match="ngram must be <= 32, got 33"):
            client.generate(text="hello there", max_new_tokens=4, ngram=33)
        with pytest.raises(InvalidArgument, match="vocabulary"):
            client.generate(token_ids=[1, 10**7], max_new_tokens=4)


def test_cli_publish_and_generate_endpoint(
    service, tenants, builtin_model, builtin_runner, capsys, tmp_path
):
    doc = tmp_path / "doc.py"
    doc.write_text(builtin_model.decode(builtin_model.encode(inspect.getsource(json))[:300]))
    token = tenants["c"]
    capsys.readouterr()
    assert main(["publish", "--token", token, "--file", str(doc), "--json"]) == 0
    published = json.loads(capsys.readouterr().out)
    assert published["tokens"] == len(builtin_model.encode(doc.read_text()))
    prompt = doc.read_text() + "\n# Usage:"
    args = ["generate", "--endpoint", service.decoders[0], "--token", token]
    assert (
        main(
            [
                *args,
                "--prompt",
                prompt,
                "--max-new-tokens",
                "12",
                "--mode",
                "vericache",
                "--json",
                "--seed",
                "5",
                "--temperature",
                "0.7",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    ids = builtin_model.encode(prompt)
    want = full_kv_tokens(
        builtin_runner, builtin_model, ids, 12, SamplingParams(temperature=0.7, seed=5)
    )
    assert out["tokens"] == want and out["stats"]["mode"] == "vericache"
    assert out["stats"]["cached_tokens"] > 0
    assert main([*args[:3], "--prompt", "x"]) == 2  # no token
    assert "--token is required" in capsys.readouterr().err


@pytest.mark.kills_parts
def test_shard_lost_mid_request_replica_then_recompute(
    service, document, builtin_model, builtin_runner
):
    """Run after the other tests sharing `service` (`kills_parts`), so with a tenant of its
    own: this module's fixtures are set up again by then."""
    from prefix_store.metadata import Metadata

    token = Metadata(service.redis_url).add_tenant("remote-shard-lost", 0)
    doc_ids = builtin_model.encode(document)
    prompt = doc_ids + builtin_model.encode("\n# Rewrite fill() in one line:\n")[1:]
    want = full_kv_tokens(builtin_runner, builtin_model, prompt, 64)
    killed: list[int] = []
    try:
        with decoder(service, token) as client:
            client.publish(token_ids=doc_ids, compressors=["snapkv:budget=0.125"])
            for kill in ([0], [1]):  # first a replica remains; then none does (recompute)
                reply_tokens: list[int] = []
                stream = client.stream(
                    token_ids=prompt, max_new_tokens=64, horizon=2, reply=(reply := _Reply())
                )
                for piece in stream:
                    reply_tokens.extend(piece.tokens)
                    if len(reply_tokens) >= 4 and kill:
                        for index in kill:
                            service.kill_shard(index)
                            killed.append(index)
                        kill = []
                assert reply.tokens == want[: len(reply.tokens)] and reply.tokens == want
            assert reply.stats["recomputed"] is True
    finally:  # the deployment is shared (tests/cluster/conftest.py `service`)
        for index in killed:
            service.start_shard(index)


def _Reply():
    from decoder.service.client import GenerateReply

    return GenerateReply()


def test_the_routers_openai_api_serves_full_kv_outputs(
    service, tenants, builtin_model, builtin_runner
):
    import openai

    from cluster.state import read_state

    url = service.http[0]
    assert read_state()["http"] == [url]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=tenants["c"], max_retries=0)
    messages = [{"role": "user", "content": "Name three colors."}]
    ids = builtin_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=NEW, temperature=0
    )
    assert reply.choices[0].message.content == builtin_model.decode(
        reference(builtin_runner, builtin_model, ids)
    )
    assert reply.model_extra["vericache"]["failovers"] == 0


def test_every_dashboard_panel_queries_metrics_the_live_deployment_exports(service):
    """docs/grafana/vericache.json against a scrape of every metrics endpoint the state
    file lists: each metric a query names is exported, each label it groups or selects by
    is one of that metric's (run after the tests above, so that labelled series exist)."""
    import re
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    from cluster.state import read_state
    from prefix_store.metrics import scrape

    state = read_state()
    assert {"shard-0", "decoder-0", "router-0"} <= set(state["metrics"])
    labels: dict[str, set[str]] = {}
    for url in state["metrics"].values():
        for family in text_string_to_metric_families(scrape(url, state["metrics_token"])):
            suffixes = {"counter": ("_total", "_created"), "histogram": HISTOGRAM}
            for name in (family.name, *(family.name + s for s in suffixes.get(family.type, ()))):
                labels.setdefault(name, set())
            for sample in family.samples:
                labels.setdefault(sample.name, set()).update(sample.labels)
    dashboard = json.loads((Path(__file__).parents[2] / "docs/grafana/vericache.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 15
    for expr in exprs:
        names = set(re.findall(r"\bvericache_[a-z_]+", expr))
        assert names and names <= set(labels), (expr, names - set(labels))
        used = set(re.findall(r"by \(([^)]*)\)", expr)) | set(re.findall(r"(\w+)=\"", expr))
        used = {label.strip() for group in used for label in group.split(",")} - {"le"}
        sampled = [n for n in names if labels[n]]  # no samples yet: its labels are unknown
        known = set().union(*(labels[n] for n in sampled))
        assert not sampled or used <= known, (expr, used - known)


HISTOGRAM = ("_bucket", "_sum", "_count", "_created")
