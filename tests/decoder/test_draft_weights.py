"""Low-precision draft weights: fast mode only, built lazily, exact mode bitwise untouched."""

from __future__ import annotations

import pytest
import torch

import decoder.runner as runner_module
from decoder.config import RunnerConfig
from decoder.engine import Engine, EngineConfig
from decoder.runner import ModelRunner, SeqInput
from decoder.weights import random_weights
from tests.decoder.test_exactness import TINY_CONFIGS

TINY = TINY_CONFIGS["gqa-tied"]
LOW_PRECISION = ("fp16", "int8", "bf16")


def tiny_runner(draft_weights: str) -> ModelRunner:
    return ModelRunner(
        TINY, random_weights(TINY, seed=3), RunnerConfig(key_chunk=32, draft_weights=draft_weights)
    )


def logits_all(runner: ModelRunner, tokens: list[int], mode: str) -> torch.Tensor:
    cache = runner.new_cache()
    return runner.forward([SeqInput.extend(cache, tokens, "all")], mode)[0]


@pytest.mark.parametrize("bad", ["int4", "FP32", "", None])
def test_invalid_draft_weights_rejected(bad):
    with pytest.raises(ValueError, match="draft_weights must be one of"):
        RunnerConfig(draft_weights=bad)


def test_default_draft_weights_is_fp16():
    assert RunnerConfig().draft_weights == "fp16"


@pytest.mark.parametrize("kind", LOW_PRECISION)
def test_copy_built_only_at_first_fast_forward(kind, monkeypatch):
    built = []
    make = runner_module.low_precision_linear
    monkeypatch.setattr(
        runner_module, "low_precision_linear", lambda w, k: built.append(k) or make(w, k)
    )
    runner = tiny_runner(kind)
    logits_all(runner, [1, 2, 3], "exact")
    assert built == [] and runner.draft_weight_bytes == 0
    logits_all(runner, [1, 2, 3], "fast")
    assert built == [kind] * (4 * TINY.num_layers + 1)  # four linears per layer, lm_head
    assert runner.draft_weight_bytes > 0
    logits_all(runner, [4, 5], "fast")
    assert len(built) == 4 * TINY.num_layers + 1  # built once


@pytest.mark.parametrize(("mode", "built"), [("full", False), ("lossy", True), ("vericache", True)])
def test_an_engine_that_drafts_builds_the_copy_before_its_first_timed_step(mode, built):
    """The copy is built when a drafting engine is made, not inside its first draft step,
    whose time the horizon policy reads as the price of drafting."""
    runner = tiny_runner("fp16")
    Engine(runner, EngineConfig(mode=mode, compressor="streamingllm:sink=4,window=28"))
    assert (runner.draft_weight_bytes > 0) == built


def test_fp32_drafts_with_the_exact_weights():
    runner = tiny_runner("fp32")
    logits_all(runner, [1, 2, 3], "fast")
    assert runner.draft_weight_bytes == 0


@pytest.mark.parametrize("kind", LOW_PRECISION)
def test_copy_is_smaller_than_fp32(kind):
    runner = tiny_runner(kind)
    logits_all(runner, [1, 2, 3], "fast")
    fp32_linear_bytes = runner.weights.nbytes - (
        runner.weights.embed.nbytes + runner.weights.final_norm.nbytes
    )
    fp32_linear_bytes += runner.weights.lm_head.nbytes  # tied: counted once in nbytes
    assert runner.draft_weight_bytes < fp32_linear_bytes


@pytest.mark.parametrize("kind", LOW_PRECISION)
def test_exact_logits_bitwise_unchanged(kind):
    tokens = list(range(5, 45))
    reference = logits_all(tiny_runner("fp32"), tokens, "exact")
    runner = tiny_runner(kind)
    assert torch.equal(logits_all(runner, tokens, "exact"), reference)
    logits_all(runner, tokens, "fast")  # the draft copy exists now
    assert torch.equal(logits_all(runner, tokens, "exact"), reference)


@pytest.mark.parametrize("kind", LOW_PRECISION)
def test_fast_logits_close_on_tiny_model(kind):
    tokens = list(range(5, 45))
    fp32 = logits_all(tiny_runner("fp32"), tokens, "fast")
    low = logits_all(tiny_runner(kind), tokens, "fast")
    assert (low - fp32).norm() / fp32.norm() < 0.1
    assert (low.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("kind", LOW_PRECISION)
def test_builtin_model_drafts_agree_with_fp32(builtin_model, builtin_runner, kind):
    """Decode steps (one row each, as drafting does) over the short prompt's greedy
    continuation: the low-precision drafter picks the fp32 drafter's token almost always."""
    m = builtin_model
    prompt = m.encode("Write a Python function that reverses a list.", chat=True)
    prefix = builtin_runner.new_cache(capacity=len(prompt) + 40)
    builtin_runner.forward([SeqInput.extend(prefix, prompt[:-1], "none")])
    low = ModelRunner(m.config, m.weights, RunnerConfig(draft_weights=kind, self_check=False))
    picks: dict[str, list[int]] = {"fp32": [], kind: []}
    caches = {"fp32": prefix.clone(extra_capacity=40), kind: prefix.clone(extra_capacity=40)}
    token = prompt[-1]
    for _ in range(32):
        for name, runner in (("fp32", builtin_runner), (kind, low)):
            logits = runner.forward([SeqInput.extend(caches[name], [token])], "fast")[0]
            picks[name].append(int(logits[-1].argmax()))
        token = picks["fp32"][-1]  # both follow the fp32 drafter's sequence
    agree = sum(a == b for a, b in zip(picks["fp32"], picks[kind], strict=True)) / 32
    assert agree >= 0.75, (agree, picks)
    assert low.draft_weight_bytes > 0
