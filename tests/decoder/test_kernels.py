"""The fused exact-attention kernel: bitwise independent of grouping, close to float64.

Each query row's result must be a function of its own query, its position and the keys at
positions <= it (the exact-mode contract, DESIGN.md section 5): rows alone or batched,
tokens split across calls, key chunks walked over several calls, more or fewer threads,
future keys present or absent (and holding anything finite) give the same bits.
"""

from __future__ import annotations

import pytest
import torch

from decoder.config import ModelConfig, RunnerConfig
from decoder.runner import ModelRunner, SeqInput
from decoder.weights import random_weights
from numerics.cpu import fused as fused_ext
from numerics.cpu.forward import (
    TORCH_KERNEL_ID,
    AttentionPlan,
    AttentionState,
    attend_chunks,
    exact_attention,
    exact_kernel_id,
)

pytestmark = pytest.mark.fused_kernel  # skips only where the CPU cannot run it

# (heads, kv_heads, head_dim, key_chunk): GQA groups of 3 and 4, MQA, MHA, odd head sizes.
SHAPES = [(9, 3, 64, 256), (8, 2, 16, 32), (8, 1, 32, 32), (3, 3, 72, 64), (4, 2, 64, 32)]


def problem(heads, kv_heads, dim, keys, tokens, start, seed=0):
    """Random q [T, H, D] (scaled like the runner's), keys/values [KVH, keys, D], positions."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=g) * (2.0 / dim**0.5)
    k = torch.randn(kv_heads, keys, dim, generator=g)
    v = torch.randn(kv_heads, keys, dim, generator=g)
    return q, k, v, torch.arange(start, start + tokens)


def fused(q, k, v, positions, chunk):
    group = q.shape[1] // k.shape[0]
    plan = AttentionPlan.build(
        positions, group, key_chunk=chunk, row_tile=4, query_block=256, fused=True
    )
    return exact_attention(q, k, v, plan)


def reference(q, k, v, positions):
    """float64 causal attention: query t sees keys [0, positions[t]]."""
    group = q.shape[1] // k.shape[0]
    keys = k.double().repeat_interleave(group, 0)
    values = v.double().repeat_interleave(group, 0)
    scores = torch.einsum("thd,hnd->thn", q.double(), keys)
    hidden = torch.arange(k.shape[1])[None, :] > positions[:, None]  # [T, n]
    scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
    return torch.einsum("thn,hnd->thd", scores.softmax(-1), values)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "chunk"), SHAPES)
def test_agrees_with_float64_reference(heads, kv_heads, dim, chunk):
    q, k, v, pos = problem(heads, kv_heads, dim, 5 * chunk, 21, 3 * chunk - 7)
    got = fused(q, k, v, pos, chunk)
    torch.testing.assert_close(got.double(), reference(q, k, v, pos), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "chunk"), SHAPES)
def test_rows_alone_equal_rows_batched(heads, kv_heads, dim, chunk):
    q, k, v, pos = problem(heads, kv_heads, dim, 4 * chunk, 19, 2 * chunk - 9, seed=1)
    batched = fused(q, k, v, pos, chunk)
    for t in range(q.shape[0]):
        alone = fused(q[t : t + 1].clone(), k, v, pos[t : t + 1], chunk)
        assert torch.equal(alone, batched[t : t + 1]), f"token {t}"
    # Tokens from anywhere, in any order, in one call.
    order = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(2))
    shuffled = fused(q[order].contiguous(), k, v, pos[order].contiguous(), chunk)
    assert torch.equal(shuffled, batched[order])


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "chunk"), SHAPES)
def test_tokens_split_across_calls(heads, kv_heads, dim, chunk):
    q, k, v, pos = problem(heads, kv_heads, dim, 4 * chunk, 40, chunk - 20, seed=3)
    whole = fused(q, k, v, pos, chunk)
    for cuts in ([0, 1, 2, 40], [0, 17, 20, 21, 40], [0, 13, 26, 39, 40]):
        pieces = [
            fused(q[a:b].contiguous(), k, v, pos[a:b].contiguous(), chunk)
            for a, b in zip(cuts[:-1], cuts[1:], strict=True)
        ]
        assert torch.equal(torch.cat(pieces), whole), cuts


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "chunk"), SHAPES)
def test_future_keys_never_enter(heads, kv_heads, dim, chunk):
    """Keys after a row's position, absent (a cache just long enough) or present with huge
    values, change no bit; neither does the capacity of the cache."""
    q, k, v, pos = problem(heads, kv_heads, dim, 3 * chunk, 12, chunk - 6, seed=4)
    last = int(pos[-1])
    short_k, short_v = k[:, : last + 1].clone(), v[:, : last + 1].clone()
    want = fused(q, short_k, short_v, pos, chunk)
    loud_k, loud_v = k.clone(), v.clone()
    loud_k[:, last + 1 :] = 1e4
    loud_v[:, last + 1 :] = -1e4
    assert torch.equal(fused(q, loud_k, loud_v, pos, chunk), want)
    assert torch.equal(fused(q, k, v, pos, chunk), want)
    for t in range(q.shape[0]):  # and each row alone, with its own future present
        k_t = loud_k.clone()
        k_t[:, int(pos[t]) + 1 :] = -3e3
        got = fused(q[t : t + 1].clone(), k_t, loud_v, pos[t : t + 1], chunk)
        assert torch.equal(got, want[t : t + 1])


@pytest.mark.parametrize("chunk", [32, 256])
def test_masks_at_chunk_boundaries(chunk):
    """Rows at the last slot of a chunk, the first of the next and the one after: each sees
    exactly keys [0, own position] (checked against float64 with loud future keys)."""
    positions = torch.tensor([chunk - 2, chunk - 1, chunk, chunk + 1, 2 * chunk - 1, 2 * chunk])
    q, k, v, _ = problem(8, 2, 32, 3 * chunk, positions.numel(), 0, seed=5)
    for t, p in enumerate(positions.tolist()):
        k_t, v_t = k.clone(), v.clone()
        k_t[:, p + 1 :] = 50.0  # would dominate every score if it leaked in
        v_t[:, p + 1 :] = 1e3
        got = fused(q[t : t + 1].clone(), k_t, v_t, positions[t : t + 1], chunk)
        want = reference(q[t : t + 1], k_t, v_t, positions[t : t + 1])
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_chunks_walked_over_several_calls_equal_one_call():
    """The online-softmax state carried between calls gives bitwise the one-call result
    (shared-prefix attention walks a prefix's full chunks once for many rows)."""
    heads, kv_heads, dim, chunk = 9, 3, 64, 64
    q, k, v, pos = problem(heads, kv_heads, dim, 6 * chunk, 10, 4 * chunk + 3, seed=6)
    want = fused(q, k, v, pos, chunk)
    for first in (1, 2, 4):
        state = AttentionState.start(*q.shape)
        attend_chunks(q, k, v, pos, state, key_chunk=chunk, stop_chunk=first)
        head, tail = state.tokens(0, 4), state.tokens(4, 10)  # continued in two calls
        attend_chunks(q[:4], k, v, pos[:4], head, key_chunk=chunk, first_chunk=first, finish=True)
        attend_chunks(q[4:], k, v, pos[4:], tail, key_chunk=chunk, first_chunk=first, finish=True)
        assert torch.equal(state.acc, want), first


def test_thread_count_changes_no_bit():
    q, k, v, pos = problem(9, 3, 64, 8192, 32, 8000, seed=7)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(fused(q, k, v, pos, 256))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results)


def test_bad_inputs_are_refused():
    q, k, v, pos = problem(8, 2, 16, 64, 4, 60)
    fused(q, k, v, pos, 32)  # positions 60..63: the last slot is the last key
    with pytest.raises(RuntimeError, match="position 64 is beyond the 64 slots"):
        fused(q, k, v, pos + 1, 32)
    state = AttentionState.start(*q.shape)
    with pytest.raises(RuntimeError, match="contiguous int64"):
        attend_chunks(q, k, v, pos.to(torch.int32), state, key_chunk=32)
    with pytest.raises(RuntimeError, match="not available"):  # head size 12: torch kernel
        attend_chunks(q[..., :12].contiguous(), k[..., :12], v[..., :12], pos, state, key_chunk=32)


def test_kernel_id_names_the_fused_kernel():
    kernel_id = exact_kernel_id(64)
    assert kernel_id.startswith("fused-avx2-")
    assert fused_ext.source_digest()[:12] in kernel_id
    assert exact_kernel_id(20) == TORCH_KERNEL_ID  # head sizes the kernel does not serve


@pytest.fixture
def torch_kernel(monkeypatch):
    """This process as one configured with VERICACHE_EXACT_KERNEL=torch."""
    monkeypatch.setenv(fused_ext.ENV, "torch")
    monkeypatch.setattr(fused_ext, "_loaded", {})


def test_fallback_when_the_kernel_is_disabled(torch_kernel):
    assert fused_ext.module() is None
    assert exact_kernel_id(64) == TORCH_KERNEL_ID
    config = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    runner = ModelRunner(config, random_weights(config, seed=1), RunnerConfig(key_chunk=32))
    tokens = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(8))
    plan = runner._plan(SeqInput.extend(runner.new_cache(), tokens))
    assert not plan.fused and plan.blocks
    whole = runner.new_cache()
    want = runner.forward([SeqInput.extend(whole, tokens, "all")])[0]
    pieces = runner.new_cache()
    cuts = [(0, 31), (31, 33), (33, 70)]
    got = [runner.forward([SeqInput.extend(pieces, tokens[a:b], "all")])[0] for a, b in cuts]
    assert torch.equal(torch.cat(got), want)


def test_invalid_kernel_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(fused_ext.ENV, "fastest")
    with pytest.raises(ValueError, match="must be 'fused' or 'torch'"):
        fused_ext.wanted()
