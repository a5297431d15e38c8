"""The full-KV reference decoder: `generate_full_each` decodes several samplings of the
same prompts from one prefill, exactly as one `generate_full` per sampling would."""

from __future__ import annotations

import difflib
import inspect

import pytest

from decoder.generate import generate_full, generate_full_each
from decoder.sampling import SamplingParams

SAMPLINGS = (
    SamplingParams(),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7),
    SamplingParams(temperature=1.0, seed=8),
)


def test_each_sampling_is_its_own_generate_full_from_one_prefill(builtin_model, builtin_runner):
    source = builtin_model.encode(inspect.getsource(difflib))
    prompts = [source[:90], source[200:380], source[400:403]]
    eos = builtin_model.eos_token_ids
    want = [
        [r.tokens for r in generate_full(builtin_runner, prompts, max_new_tokens=12, sampling=s)]
        for s in SAMPLINGS
    ]
    fed: list[int] = []
    forward = builtin_runner.forward

    def counting(seqs, mode="exact"):
        fed.append(sum(len(s.tokens) for s in seqs))
        return forward(seqs, mode)

    builtin_runner.forward = counting
    try:
        each = generate_full_each(
            builtin_runner, prompts, SAMPLINGS, max_new_tokens=12, eos_token_ids=eos
        )
    finally:
        del builtin_runner.forward
    assert [[r.tokens for r in results] for results in each] == want
    assert len({tuple(w) for w in want[0]} | {tuple(w) for w in want[1]}) > 3, "samplings differ"
    assert fed[0] == sum(len(p) for p in prompts)  # one prefill for every sampling
    assert all(n <= len(SAMPLINGS) * len(prompts) for n in fed[1:])  # then one token each
    assert "seed" not in each[0][0].stats and each[1][0].stats["seed"] == 7


def test_no_sampling_is_a_clear_error(builtin_runner):
    with pytest.raises(ValueError, match="at least one sampling"):
        generate_full_each(builtin_runner, [[1, 2, 3]], [], max_new_tokens=4)
