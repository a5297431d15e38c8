"""Every registered compressor is lossless end to end, at a size `make test` affords: a short
prompt, 16 new tokens, greedy and seeded, VeriCache token for token full-KV decoding.

The prompt is hard enough for the check to mean something: lossy decoding with each spec
here (the compressed prefix alone) diverges from these references within the 16 tokens,
greedy and seeded (measured when this was written). The full matrix (eight 1-2K prompts, 64
tokens, four horizons, n-gram guesses) is tests/decoder/test_engine.py's, under `slow`. This
one follows `REGISTRY`, so a new method is checked here the day it is registered.
"""

from __future__ import annotations

import difflib
import inspect

import pytest

from decoder.compressors.registry import REGISTRY
from decoder.engine import Engine, EngineConfig, Request, split_prompt
from decoder.generate import generate_full_each
from decoder.sampling import SamplingParams

PROMPT_TOKENS = 320
NEW_TOKENS = 16
SAMPLINGS = (SamplingParams(), SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7))


@pytest.fixture(scope="module")
def reference(builtin_model, builtin_runner):
    """The prompt split into its cached prefix and last token, and its full-KV tokens per
    sampling: computed once, shared by every compressor."""
    prompt = builtin_model.encode(inspect.getsource(difflib))[:PROMPT_TOKENS]
    eos = builtin_model.eos_token_ids
    each = generate_full_each(
        builtin_runner, [prompt], SAMPLINGS, max_new_tokens=NEW_TOKENS, eos_token_ids=eos
    )
    want = {s: results[0].tokens for s, results in zip(SAMPLINGS, each, strict=True)}
    return split_prompt(builtin_runner, prompt), want


SPECS = [*sorted(REGISTRY), "snapkv+kivi"]
"""Each method with its default parameters, and one composition (drop, then quantize)."""


@pytest.mark.parametrize("spec", SPECS)
def test_each_compressor_decodes_exactly_the_full_kv_tokens(
    spec, builtin_model, builtin_runner, reference
):
    """The compressed prefix drafts; every pass pulls the full prefix (resident=False) to
    verify. Both requests decode together in one engine."""
    (prefix, suffix), want = reference
    config = EngineConfig(mode="vericache", compressor=spec, resident=False)
    engine = Engine(builtin_runner, config, builtin_model.eos_token_ids)
    try:
        results = engine.run([Request(prefix, suffix, NEW_TOKENS, s) for s in SAMPLINGS])
    finally:
        prefix.artifacts.clear()
    for sampling, result in zip(SAMPLINGS, results, strict=True):
        kind = "greedy" if sampling.greedy else "seeded"
        assert result.tokens == want[sampling], f"{spec}, {kind}"
        assert len(result.tokens) == NEW_TOKENS, "no early stop: all 16 tokens are compared"
        stats = result.stats
        assert stats["verifications"] >= 1
        assert 0 < stats["compressed_bytes"] < stats["full_bytes"], "it really compressed"
