"""Token choice: greedy arg-max, and seeded sampling keyed only by (seed, position)."""

from __future__ import annotations

import pytest
import torch

from decoder.sampling import Sampler, SamplingParams


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([0.0, 3.0, 3.0, -1.0])
    assert Sampler(SamplingParams()).choose(logits, 0) == 1


def test_seeded_choice_depends_only_on_seed_position_and_logits():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)
    a, b = Sampler(params), Sampler(params)
    first = [a.choose(logits, i) for i in range(20)]
    assert [b.choose(logits, i) for i in reversed(range(20))] == first[::-1]
    assert a.choose_rows(logits.expand(5, -1), 3) == first[3:8]
    assert len(set(first)) > 5, "different positions draw different noise"
    other = Sampler(SamplingParams(temperature=1.0, seed=43))
    assert [other.choose(logits, i) for i in range(20)] != first


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=7))
    counts = (
        torch.bincount(
            torch.tensor([sampler.choose(logits, i) for i in range(3000)]), minlength=3
        ).double()
        / 3000
    )
    assert torch.allclose(counts, torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64), atol=0.04)


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    top_k = Sampler(SamplingParams(temperature=5.0, top_k=2, seed=1))
    assert {top_k.choose(logits, i) for i in range(300)} == {0, 1}
    probs = torch.softmax(logits, 0)  # ~0.64, 0.23, 0.09, ...
    top_p = Sampler(SamplingParams(temperature=1.0, top_p=float(probs[0] + 0.01), seed=1))
    assert {top_p.choose(logits, i) for i in range(300)} == {0, 1}


def test_unseeded_sampling_gets_a_reported_seed():
    sampler = Sampler(SamplingParams(temperature=0.7))
    assert sampler.params.seed is not None
    assert Sampler(SamplingParams()).params.seed is None


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -1}]
)
def test_bad_parameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
