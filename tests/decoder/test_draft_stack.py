"""Drafter stacking: requests of one draft forward over the same compressed prefix attend
together (one call over the prefix for all their rows, one batched call over their own
tails, merged by log-sum-exp). Their logits and draft tails must be what each request gets
when it drafts alone, through the per-request path."""

from __future__ import annotations

import pytest
import torch

from decoder.compressors import parse_compressor
from decoder.config import ModelConfig, RunnerConfig
from decoder.draft_cache import DraftCache, DraftPrefix, DraftScratch, draft_stacks
from decoder.engine.prefix_work import compress, prefill_prefix
from decoder.runner import ModelRunner, SeqInput
from decoder.weights import random_weights

CONFIG = ModelConfig(
    vocab_size=400,
    hidden_size=96,
    intermediate_size=160,
    num_layers=3,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
)
PREFIX = 300


@pytest.fixture(scope="module")
def runner():
    rc = RunnerConfig(key_chunk=32, draft_weights="fp32")
    return ModelRunner(CONFIG, random_weights(CONFIG, seed=5), rc)


def ids(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=generator).tolist()


@pytest.fixture(scope="module", params=["snapkv:budget=0.25", "kivi:bits=4,residual=32"])
def prefix(request, runner):
    """A compressed prefix: token-dropping (per-head positions) or quantized (decoded into
    the shared scratch at each layer)."""
    pipeline = parse_compressor(request.param)
    prefix = prefill_prefix(runner, ids(PREFIX, 1), observe=pipeline.observe_window)
    compressed = compress(pipeline, prefix, CONFIG)
    scratch = DraftScratch(CONFIG.num_kv_heads, CONFIG.head_dim)
    return DraftPrefix(compressed, CONFIG.num_kv_heads, CONFIG.head_dim, scratch)


# Per request, the tokens of each draft forward: several at once (checked n-gram guesses)
# or one, so that tails of different lengths and rows of different counts meet.
FEEDS = [
    [ids(3, 10), ids(1, 11), ids(2, 12)],
    [ids(1, 20), ids(4, 21), ids(1, 22)],
    [ids(2, 30), ids(1, 31), ids(1, 32)],
]


def draft(runner, caches, feeds):
    seqs = [SeqInput.extend(c, f, "all") for c, f in zip(caches, feeds, strict=True)]
    return runner.forward(seqs, "fast")


def test_stacked_drafts_equal_each_request_drafting_alone(runner, prefix):
    together = [DraftCache(prefix, 16) for _ in range(3)]
    alone = [DraftCache(prefix, 16) for _ in range(3)]
    for step, feeds in enumerate(FEEDS):
        seqs = [SeqInput.extend(c, f, "all") for c, f in zip(together, feeds, strict=True)]
        assert set(draft_stacks(seqs, [(0, 1)] * 3, 1.0)) == {0, 1, 2}, "one stack of three"
        stacked = draft(runner, together, feeds)
        for i, cache in enumerate(alone):
            (want,) = draft(runner, [cache], [feeds[i]])
            torch.testing.assert_close(stacked[i], want, rtol=1e-4, atol=1e-4)
            assert together[i].tail_length == cache.tail_length, f"step {step}"


def test_a_rolled_back_member_stacks_with_the_others(runner, prefix):
    """Rollback (truncate) between forwards, as after a rejected draft: the stack reads only
    each member's live tail."""
    together = [DraftCache(prefix, 16) for _ in range(2)]
    alone = [DraftCache(prefix, 16) for _ in range(2)]
    for caches in (together, alone):
        for cache, feed in zip(caches, ([1, 2, 3, 4], [5, 6]), strict=True):
            draft(runner, [cache], [feed])
        caches[0].truncate(1)
    stacked = draft(runner, together, [[7], [8, 9]])
    for i, cache in enumerate(alone):
        (want,) = draft(runner, [cache], [[[7], [8, 9]][i]])
        torch.testing.assert_close(stacked[i], want, rtol=1e-4, atol=1e-4)


def test_requests_over_different_prefixes_do_not_stack(runner, prefix):
    other = DraftPrefix(
        prefix.compressed, CONFIG.num_kv_heads, CONFIG.head_dim, DraftScratch(2, 16)
    )
    caches = [DraftCache(prefix, 8), DraftCache(other, 8), DraftCache(prefix, 8)]
    seqs = [SeqInput.extend(c, [1], "all") for c in caches]
    stacks = draft_stacks(seqs, [(0, 1), (1, 2), (2, 3)], 1.0)
    assert set(stacks) == {0, 2} and stacks[0] is stacks[2]
