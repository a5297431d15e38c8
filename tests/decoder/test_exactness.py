"""Exact mode: per-token logits and KV are bitwise independent of grouping, batch and future."""

from __future__ import annotations

import pytest
import torch

from decoder.config import ModelConfig, RopeConfig, RunnerConfig
from decoder.errors import ExactModeUnsupported
from decoder.runner import ModelRunner, SeqInput
from decoder.weights import random_weights

TINY_CONFIGS = {
    "gqa-tied": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    ),
    "mha-untied": ModelConfig(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=160,
        num_layers=3,
        num_heads=3,
        num_kv_heads=3,
        head_dim=32,
    ),
    "mqa-llama3-rope": ModelConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=352,
        num_layers=2,
        num_heads=8,
        num_kv_heads=1,
        head_dim=16,
        rope=RopeConfig(
            theta=500000.0,
            kind="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_positions=64,
        ),
    ),
}
# Small key chunks and query blocks so that 100 tokens cross many chunk and block boundaries.
# Fast mode drafts with the fp32 weights here: its kernels are compared with exact mode's.
TINY_RC = RunnerConfig(key_chunk=32, query_block=48, draft_weights="fp32")
T = 100


def run_pieces(runner: ModelRunner, tokens: torch.Tensor, cuts: list[int], capacity: int = 0):
    """Feed tokens[cuts[i]:cuts[i+1]] call by call; return all logits [T, V] and the cache."""
    cache = runner.new_cache(capacity)
    logits = [
        runner.forward([SeqInput.extend(cache, tokens[s:e], "all")])[0]
        for s, e in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    return torch.cat(logits), cache


def assert_bitwise(logits_a, cache_a, logits_b, cache_b, n: int) -> None:
    assert torch.equal(logits_a[:n], logits_b[:n]), "logits differ"
    for i, (la, lb) in enumerate(zip(cache_a.layers, cache_b.layers, strict=True)):
        assert torch.equal(la.k[:, :n], lb.k[:, :n]), f"layer {i} keys differ"
        assert torch.equal(la.v[:, :n], lb.v[:, :n]), f"layer {i} values differ"


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny(request):
    config = TINY_CONFIGS[request.param]
    runner = ModelRunner(config, random_weights(config, seed=7), TINY_RC)
    tokens = torch.randint(0, config.vocab_size, (T,), generator=torch.Generator().manual_seed(3))
    stepwise = run_pieces(runner, tokens, list(range(T + 1)))  # one token per call
    return runner, tokens, stepwise


def test_prefill_equals_token_by_token_decode(tiny):
    runner, tokens, (step_logits, step_cache) = tiny
    logits, cache = run_pieces(runner, tokens, [0, T])
    assert_bitwise(logits, cache, step_logits, step_cache, T)


@pytest.mark.parametrize("k", [2, 3, 5, 8, 16, 17, 33])
def test_k_token_chunks_equal_decode(tiny, k):
    runner, tokens, (step_logits, step_cache) = tiny
    logits, cache = run_pieces(runner, tokens, [*range(0, T, k), T])
    assert_bitwise(logits, cache, step_logits, step_cache, T)


def test_cache_capacity_does_not_matter(tiny):
    runner, tokens, (step_logits, step_cache) = tiny
    logits, cache = run_pieces(runner, tokens, [0, 40, 41, T], capacity=1000)
    assert_bitwise(logits, cache, step_logits, step_cache, T)


def test_following_context_does_not_change_a_prefix(tiny):
    runner, tokens, _ = tiny
    alone, alone_cache = run_pieces(runner, tokens[:60], [0, 60])
    other = tokens.clone()
    other[60:] = (other[60:] + 1) % runner.config.vocab_size
    for continuation in (tokens, other):
        logits, cache = run_pieces(runner, continuation, [0, T])
        assert_bitwise(logits, cache, alone, alone_cache, 60)


def test_batch_equals_each_alone(tiny):
    runner, tokens, _ = tiny
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, runner.config.vocab_size, (n,), generator=g) for n in (1, 37, 70)]
    steps = [(0, 5), (1, 1), (3, 9)]  # second call: each sequence adds a different chunk size

    def run(batch: list[int]):
        caches = {i: runner.new_cache() for i in batch}
        first = runner.forward([SeqInput.extend(caches[i], prompts[i], "all") for i in batch])
        nxt = [tokens[steps[i][0] : steps[i][0] + steps[i][1]] for i in batch]
        second = runner.forward(
            [SeqInput.extend(caches[i], x, "all") for i, x in zip(batch, nxt, strict=True)]
        )
        return {
            i: (torch.cat([f, s]), caches[i]) for i, f, s in zip(batch, first, second, strict=True)
        }

    together = run([0, 1, 2])
    for i in range(3):
        ((alone_logits, alone_cache),) = run([i]).values()
        logits, cache = together[i]
        assert_bitwise(logits, cache, alone_logits, alone_cache, len(cache))


def test_builtin_model_grouping_batch_and_future(builtin_runner):
    """The real model (256-key chunks): prefill vs pieces crossing a chunk, batch, future."""
    runner = builtin_runner
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, runner.config.vocab_size, (300,), generator=g)
    other = torch.randint(0, runner.config.vocab_size, (50,), generator=g)
    whole_logits, whole = run_pieces(runner, tokens, [0, 300])

    cache, neighbour = runner.new_cache(), runner.new_cache()
    got = [runner.forward([SeqInput.extend(cache, tokens[:240], "all")])[0]]
    for t in range(240, 260):  # single decode steps across the chunk boundary at 256
        got.append(runner.forward([SeqInput.extend(cache, tokens[t : t + 1], "all")])[0])
    got.append(runner.forward([SeqInput.extend(cache, tokens[260:291], "all")])[0])
    batched = runner.forward(
        [SeqInput.extend(neighbour, other, "all"), SeqInput.extend(cache, tokens[291:], "all")]
    )
    got.append(batched[1])
    assert_bitwise(torch.cat(got), cache, whole_logits, whole, 300)

    alone_logits, alone = run_pieces(runner, other, [0, 50])
    assert_bitwise(batched[0], neighbour, alone_logits, alone, 50)
    short_logits, short = run_pieces(runner, tokens[:120], [0, 120])
    assert_bitwise(short_logits, short, whole_logits, whole, 120)


def test_fast_mode_is_close_to_exact(tiny):
    runner, tokens, (step_logits, _) = tiny
    cache = runner.new_cache()
    fast = runner.forward([SeqInput.extend(cache, tokens, "all")], mode="fast")[0]
    torch.testing.assert_close(fast, step_logits, rtol=1e-4, atol=1e-4)


def test_exact_mode_is_refused_when_kernels_depend_on_grouping(monkeypatch):
    import decoder.runner as runner_module

    real = runner_module.exact_attention

    def grouping_dependent(q, *args, **kwargs):  # what a non-deterministic platform looks like
        return real(q, *args, **kwargs) * (1.0 + 1e-6 * q.shape[0])

    monkeypatch.setattr(runner_module, "exact_attention", grouping_dependent)
    config = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
    )
    runner = ModelRunner(config, random_weights(config), TINY_RC)
    with pytest.raises(ExactModeUnsupported, match="exact mode refused.*differ"):
        runner.forward([SeqInput.extend(runner.new_cache(), [1, 2, 3])])
    fast = runner.forward([SeqInput.extend(runner.new_cache(), [1, 2, 3])], mode="fast")
    assert fast[0].shape == (1, 64)


@pytest.mark.parametrize(
    ("tokens", "positions", "message"),
    [
        ([1, 2], [0, 2], "exact mode needs a dense cache and consecutive positions"),
        ([1, 2], [1, 0], "positions must increase"),
        ([1, 9999], [0, 1], r"token ids must be in \[0, 512\)"),
        ([], [], "non-empty"),
    ],
)
def test_malformed_input_is_a_clear_error(tokens, positions, message):
    config = TINY_CONFIGS["gqa-tied"]
    runner = ModelRunner(config, random_weights(config), TINY_RC)
    seq = SeqInput(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(positions, dtype=torch.long),
        runner.new_cache(),
    )
    with pytest.raises(ValueError, match=message):
        runner.forward([seq])


def test_cloned_cache_continues_exactly_and_independently(tiny):
    runner, tokens, (step_logits, step_cache) = tiny
    _, prefix = run_pieces(runner, tokens[:60], [0, 60])
    clone = prefix.clone(extra_capacity=T)
    logits = runner.forward([SeqInput.extend(clone, tokens[60:], "all")])[0]
    assert torch.equal(logits, step_logits[60:])
    assert len(prefix) == 60 and len(clone) == T
    assert_bitwise(step_logits, clone, step_logits, step_cache, T)
