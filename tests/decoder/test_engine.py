"""Lossless decoding: VeriCache emits exactly the full-KV tokens, for every compressor.

The reference is `generate_full`, which prefills each whole prompt at once. The engine
instead holds each prompt minus its last token as a prefix in host memory, prefills the
last token against it layer by layer, drafts with the compressed prefix and verifies. The
tokens must be identical, greedy and with seeded sampling, at every horizon.
"""

from __future__ import annotations

import inspect
import pydoc

import pytest

from decoder.engine import Engine, EngineConfig, Request, prefill_prefix, split_prompt
from decoder.generate import generate_full, generate_full_each
from decoder.sampling import SamplingParams

COMPRESSORS = [
    "streamingllm:sink=4,window=124",
    "snapkv:budget=0.125",
    "h2o:budget=0.125",
    "pyramidkv:budget=0.125",
    "kivi:bits=2",
    "kivi:bits=4",
    "kivi:bits=8",
    "snapkv:budget=0.25+kivi:bits=4",
]
HORIZONS = [1, 8, 16, None]
"""One draft, a typical fixed horizon, one far past what the drafter gets accepted (at 16 it
drafts about 2.5 tokens per accepted one here, so most rounds roll back) and auto. A
horizon of 32 tested the same rollbacks at twice the drafting: alone, 52 s of the matrix's
104 s (16: 33 s)."""
NEW_TOKENS = 40
"""Enough for several rounds at horizon 16 (with rollbacks) and for lossy drift to show; the
matrix's cost grows with it (64 tokens: 134 s of model work alone against 85 s)."""
SAMPLING = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1234)


def _prompts(model) -> list[list[int]]:
    """Eight varied prompts of 600-1200 tokens: code, prose and a chat request (the
    compressors keep 1/8 or 2-8 bits of each, far from their whole)."""
    import argparse
    import dataclasses
    import difflib
    import json.decoder
    import textwrap

    code = [inspect.getsource(m) for m in (argparse, dataclasses, difflib, json.decoder, textwrap)]
    prose = pydoc.render_doc(str, renderer=pydoc.plaintext)
    texts = [
        (code[0], 624, False),
        (code[1], 700, False),
        (code[2], 750, False),
        (code[3], 660, False),
        (code[4], 1200, False),
        (prose, 640, False),
    ]
    ids = [model.encode(text)[:n] for text, n, _ in texts]
    doc = model.decode(model.encode(code[2])[:600])
    ids.append(
        model.encode(
            f"Explain what this module does, then list its public functions:\n\n{doc}", chat=True
        )
    )
    ids.append(model.encode(prose)[2000:2660])
    assert all(600 <= len(p) <= 1200 for p in ids), [len(p) for p in ids]
    return ids


@pytest.fixture(scope="module")
def workload(builtin_model, builtin_runner):
    """The prompts, their in-memory prefixes, and full-KV references (greedy and sampled)."""
    prompts = _prompts(builtin_model)
    eos = builtin_model.eos_token_ids
    split = [split_prompt(builtin_runner, p, observe=128) for p in prompts]
    samplings = (SamplingParams(), SAMPLING)
    each = generate_full_each(
        builtin_runner, prompts, samplings, max_new_tokens=NEW_TOKENS, eos_token_ids=eos
    )
    refs = {s: [r.tokens for r in results] for s, results in zip(samplings, each, strict=True)}
    return split, refs


def _run(runner, model, workload, config, sampling):
    split, _ = workload
    engine = Engine(runner, config, model.eos_token_ids)
    requests = [Request(prefix, suffix, NEW_TOKENS, sampling) for prefix, suffix in split]
    results = engine.run(requests)
    for prefix, _ in split:
        prefix.artifacts.clear()
    return results


def _every_case(runner, model, workload, config, horizons):
    """Every prompt at each horizon, decoded together in one engine; each result checked
    against its own full-KV reference. Greedy and seeded sampling alternate over prompts and
    horizons, so that every pair (prompt, horizon), (horizon, sampler) and (prompt, sampler)
    is decoded, at half the requests of every triple. Returns (cases, results)."""
    split, refs = workload
    samplers = (SamplingParams(), SAMPLING)
    cases = [
        (samplers[(i + h) % 2], horizon, i)
        for h, horizon in enumerate(horizons)
        for i in range(len(split))
    ]
    requests = [
        Request(split[i][0], split[i][1], NEW_TOKENS, sampling, horizon)
        for sampling, horizon, i in cases
    ]
    results = Engine(runner, config, model.eos_token_ids).run(requests)
    for prefix, _ in split:
        prefix.artifacts.clear()
    for (sampling, horizon, i), result in zip(cases, results, strict=True):
        kind = "greedy" if sampling.greedy else "seeded"
        assert result.tokens == refs[sampling][i], f"prompt {i}, horizon {horizon}, {kind}"
    return cases, results


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(spec, marks=() if spec == "snapkv:budget=0.125" else (pytest.mark.slow,))
        for spec in COMPRESSORS
    ],
)
def test_vericache_is_token_for_token_full_kv(spec, builtin_model, builtin_runner, workload):
    """Every prompt at horizons 1, 8, 16 and auto, greedy or seeded (`_every_case`): 32
    requests decoded together in one engine (each with its own horizon and sampler), each
    identical to its own full-KV reference."""
    # resident=False: every pass pulls (the budget would otherwise keep all prefixes here)
    config = EngineConfig(mode="vericache", compressor=spec, resident=False)
    cases, results = _every_case(builtin_runner, builtin_model, workload, config, HORIZONS)
    for (_, horizon, _), result in zip(cases, results, strict=True):
        stats = result.stats
        assert stats["verifications"] >= 1 and stats["accepted"] <= stats["drafted"]
        if horizon is not None:
            assert stats["drafted"] <= horizon * stats["verifications"]
        assert 0 < stats["compressed_bytes"] < stats["full_bytes"]
    accepted = sum(r.stats["accepted"] for r in results)
    assert accepted > 0, "the drafts are useful, not just verified away"


NGRAM_COMPRESSORS = [
    "snapkv:budget=0.125",
    "kivi:bits=4",
    "h2o:budget=0.125",
    "streamingllm:sink=4,window=124",
]


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(spec, marks=() if spec == "snapkv:budget=0.125" else (pytest.mark.slow,))
        for spec in NGRAM_COMPRESSORS
    ],
)
def test_vericache_with_ngram_proposals_is_token_for_token_full_kv(
    spec, builtin_model, builtin_runner, workload
):
    """Prompt-lookup guesses checked by the compressed drafter, several per draft forward,
    then verified: every prompt at horizons 8 and auto, greedy or seeded, identical to
    full-KV decoding, with guesses proposed and taken, never past the horizon."""
    config = EngineConfig(mode="vericache", compressor=spec, ngram=8, resident=False)
    cases, results = _every_case(builtin_runner, builtin_model, workload, config, (8, None))
    for (_, horizon, _), result in zip(cases, results, strict=True):
        stats = result.stats
        if horizon is not None:
            assert stats["drafted"] <= horizon * stats["verifications"]
        assert stats["ngram_accepted"] <= stats["ngram_proposed"]
    assert sum(r.stats["ngram_accepted"] for r in results) > 0, "some guesses were right"
    steps = sum(r.stats["draft_steps"] for r in results)
    drafted = sum(r.stats["drafted"] for r in results)
    assert drafted > steps, "checked guesses give more than one draft per draft forward"


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLING], ids=["greedy", "seeded"])
def test_full_kv_with_ngram_proposals_is_full_kv(sampling, builtin_model, builtin_runner, workload):
    """The lossless full-KV + n-gram baseline: guesses verified by the exact pass itself."""
    split, refs = workload
    config = EngineConfig(mode="full", ngram=8)
    results = _run(builtin_runner, builtin_model, workload, config, sampling)
    assert [r.tokens for r in results] == refs[sampling]
    assert sum(r.stats["ngram_accepted"] for r in results) > 0


def test_exact_rounds_check_ngram_guesses_in_the_exact_pass(
    builtin_model, builtin_runner, workload
):
    """A request the policy keeps on exact steps (here horizon 0) still gains from its
    n-gram guesses, checked by the exact pass as in the full-KV + n-gram baseline: no draft
    forward, guesses taken, every token full KV's."""
    split, refs = workload
    config = EngineConfig(mode="vericache", horizon=0, ngram=8)
    results = _run(builtin_runner, builtin_model, workload, config, SamplingParams())
    assert [r.tokens for r in results] == refs[SamplingParams()]
    assert all(r.stats["draft_steps"] == 0 and r.stats["drafted"] == 0 for r in results)
    assert sum(r.stats["ngram_accepted"] for r in results) > 0
    assert sum(r.stats["verifications"] for r in results) < sum(len(r.tokens) - 1 for r in results)


def test_resident_and_pulled_prefixes_give_identical_tokens(
    builtin_model, builtin_runner, workload
):
    """With room in the budget, prefixes stay resident and passes pull nothing after the
    first read; under a budget that holds only some, the rest pull; the tokens are the
    full-KV tokens either way."""
    split, refs = workload
    requests = lambda: [Request(p, s, 32, SAMPLING) for p, s in split[:4]]  # noqa: E731
    want = [refs[SAMPLING][i][:32] for i in range(4)]
    full_bytes = [p.source.nbytes for p, _ in split[:4]]

    resident = Engine(
        builtin_runner, EngineConfig(mode="vericache", horizon=8), builtin_model.eos_token_ids
    ).run(requests())
    assert [r.tokens for r in resident] == want
    for result, nbytes in zip(resident, full_bytes, strict=True):
        assert result.stats["pulled_bytes"] == nbytes  # read once, then resident

    engine = Engine(
        builtin_runner,
        EngineConfig(mode="vericache", horizon=8, resident=False),
        builtin_model.eos_token_ids,
    )
    pulled = engine.run(requests())
    assert [r.tokens for r in pulled] == want
    assert all(r.stats["pulled_bytes"] > 2 * n for r, n in zip(pulled, full_bytes, strict=True))

    # Room for the compressed copies, tails and staging, plus about two full prefixes.
    tight = engine.budget.peak + 2 * max(full_bytes) + len(split) * 300_000
    some = Engine(
        builtin_runner,
        EngineConfig(mode="vericache", horizon=8, kv_budget=tight),
        builtin_model.eos_token_ids,
    ).run(requests())
    assert [r.tokens for r in some] == want
    once = sum(r.stats["pulled_bytes"] == n for r, n in zip(some, full_bytes, strict=True))
    assert 1 <= once < 4, [r.stats["pulled_bytes"] for r in some]
    for prefix, _ in split:
        prefix.artifacts.clear()


def test_lossy_mode_really_is_lossy(builtin_model, builtin_runner, workload):
    """Aggressive StreamingLLM (64 of 600+ tokens) drifts from full-KV decoding."""
    config = EngineConfig(mode="lossy", compressor="streamingllm:sink=4,window=60")
    results = _run(builtin_runner, builtin_model, workload, config, SamplingParams())
    want = workload[1][SamplingParams()]
    differs = [r.tokens != w for r, w in zip(results, want, strict=True)]
    assert sum(differs) >= 4, "most prompts diverge"
    for (prefix, _), r in zip(workload[0], results, strict=True):
        expected_ratio = prefix.source.length / 64  # positions add 4 bytes per 512 of KV
        assert r.stats["compression_ratio"] == pytest.approx(expected_ratio, rel=0.01)
        assert r.stats["compressed_bytes"] * expected_ratio == pytest.approx(
            r.stats["full_bytes"], rel=0.01
        )


def test_batched_requests_match_each_alone(builtin_model, builtin_runner, workload):
    split, refs = workload
    config = EngineConfig(mode="vericache", compressor="snapkv:budget=0.125", horizon=8)
    batch = Engine(builtin_runner, config, builtin_model.eos_token_ids).run(
        [Request(p, s, 24, SAMPLING) for p, s in split[:3]]
    )
    for (prefix, suffix), together in zip(split[:3], batch, strict=True):
        alone = Engine(builtin_runner, config, builtin_model.eos_token_ids).run(
            [Request(prefix, suffix, 24, SAMPLING)]
        )[0]
        assert alone.tokens == together.tokens == refs[SAMPLING][split.index((prefix, suffix))][:24]


@pytest.mark.parametrize("mode", ["full", "vericache"])
def test_multi_token_suffix_over_a_shared_prefix(mode, builtin_model, builtin_runner, workload):
    """Requests over one prefix with different suffixes: same as prefilling each prompt."""
    split, _ = workload
    prefix, suffix = split[0]
    tail = list(prefix.tokens[-40:])
    shared = prefill_prefix(builtin_runner, prefix.tokens[:-40], observe=128)
    suffixes = [tail + suffix, tail[:10] + [1000, 2000, 3000]]
    want = [
        r.tokens
        for r in generate_full(
            builtin_runner,
            [shared.tokens + s for s in suffixes],
            max_new_tokens=20,
            eos_token_ids=builtin_model.eos_token_ids,
        )
    ]
    engine = Engine(builtin_runner, EngineConfig(mode=mode, horizon=6), builtin_model.eos_token_ids)
    got = engine.run([Request(shared, s, 20) for s in suffixes])
    assert [r.tokens for r in got] == want
    step = "full_step_s" if mode == "full" else "draft_step_s"  # what the bound divides
    assert all(r.stats[step] > 0 for r in got)


def test_staging_holds_a_few_layers(builtin_model, builtin_runner, workload):
    split, _ = workload
    prefix, suffix = split[4]  # the 1200-token prompt
    engine = Engine(
        builtin_runner,
        EngineConfig(mode="vericache", horizon=32, staging_depth=2, resident=False),
        builtin_model.eos_token_ids,
    )
    stats = engine.run([Request(prefix, suffix, 40)])[0].stats
    c = builtin_model.config
    # prefix + tail room (suffix, new tokens, max horizon + 1), rounded up to 256-key chunks
    room = len(prefix.tokens) + len(suffix) + 40 + 33
    one_layer = 2 * c.num_kv_heads * -(-room // 256) * 256 * c.head_dim * 4
    assert stats["peak_staging_bytes"] == 2 * one_layer
    assert stats["peak_staging_bytes"] <= 2 * stats["full_bytes"] / c.num_layers * 1.2


def test_horizon_zero_and_single_token_budgets(builtin_model, builtin_runner, workload):
    split, refs = workload
    prefix, suffix = split[3]
    engine = Engine(
        builtin_runner, EngineConfig(mode="vericache", horizon=0), builtin_model.eos_token_ids
    )
    result = engine.run([Request(prefix, suffix, 5)])[0]
    assert result.tokens == refs[SamplingParams()][3][:5]
    assert result.stats["drafted"] == 0 and result.stats["verifications"] == 4
    one = engine.run([Request(prefix, suffix, 1)])[0]
    assert one.tokens == refs[SamplingParams()][3][:1] and one.stop_reason == "length"


def test_chat_request_stops_at_eos_like_full(builtin_model, builtin_runner):
    prompt = builtin_model.encode("Say hello in one short sentence.", chat=True)
    want = generate_full(
        builtin_runner, [prompt], max_new_tokens=60, eos_token_ids=builtin_model.eos_token_ids
    )[0]
    assert want.stop_reason == "eos"
    prefix, suffix = split_prompt(builtin_runner, prompt)
    for horizon in (4, None):
        got = Engine(
            builtin_runner,
            EngineConfig(mode="vericache", horizon=horizon),
            builtin_model.eos_token_ids,
        ).run([Request(prefix, suffix, 60)])[0]
        assert got.tokens == want.tokens and got.stop_reason == "eos"
        policy = got.stats["policy"]  # each round's horizon says why it was chosen
        assert sum(policy.values()) == got.stats["verifications"]
        assert set(policy) == {"fixed"} if horizon else policy["start"] == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "turbo"}, "mode must be one of full, lossy, vericache"),
        ({"horizon": -1}, "horizon must be >= 0"),
        ({"max_horizon": 0}, "max_horizon must be >= 1"),
        ({"draft_mode": "sloppy"}, "draft_mode must be 'exact' or 'fast'"),
        ({"ngram": -1}, r"ngram must be in \[0, max_horizon=32\]"),
        ({"ngram": 9, "max_horizon": 8}, r"ngram must be in \[0, max_horizon=8\]"),
    ],
)
def test_engine_config_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
