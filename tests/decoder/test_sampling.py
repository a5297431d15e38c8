"""Token choice: greedy arg-max, and seeded sampling keyed only by (seed, position)."""

from __future__ import annotations

import pytest
import torch

from decoder.sampling import Sampler, SamplingParams, _mix


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


def _gumbel_max_over_every_token(logits, params, index):
    """The definition (DESIGN.md section 1): arg-max over all V tokens of the filtered,
    temperature-scaled scores (-inf outside top-k / top-p, ties at the edge kept) plus the
    position's Gumbel noise, drawn for all V tokens."""
    scores = logits.double() / params.temperature
    if params.top_k:
        scores = scores.masked_fill(
            scores < torch.topk(scores, params.top_k).values[-1], -torch.inf
        )
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True, stable=True)
        probs = torch.softmax(ordered, dim=0)
        drop = torch.zeros_like(scores, dtype=torch.bool)
        drop[order] = torch.cumsum(probs, dim=0) - probs >= params.top_p
        scores = scores.masked_fill(drop, -torch.inf)
    generator = torch.Generator().manual_seed(_mix(params.seed, index))
    uniform = torch.rand(scores.shape[0], generator=generator, dtype=torch.float64)
    return int(torch.argmax(scores - torch.log(-torch.log(uniform.clamp(min=1e-300)))))


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(50, 0.95), (0, 0.9), (0, 1.0), (5, 1.0), (1, 0.5), (40, 0.3)]
)
def test_the_choice_is_gumbel_max_over_every_token(top_k, top_p):
    """Only the kept tokens are scored, yet the choice is the one over the whole
    vocabulary, ties at the top-k edge and at the maximum included."""
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, seed=1234)
    sampler = Sampler(params)
    generator = torch.Generator().manual_seed(0)
    for i in range(60):
        logits = torch.randn(49152, generator=generator) * (1 + i % 7)
        if i % 5 == 0:
            logits[:100] = logits.max()  # a tie across the top-k edge
        assert sampler.choose(logits, i) == _gumbel_max_over_every_token(logits, params, i)


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
