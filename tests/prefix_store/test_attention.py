"""Near-data attention's kernel contract: chunk partials computed anywhere, folded in order,
are bitwise the decoder's own one-call attention (numerics.cpu.partials)."""

from __future__ import annotations

import pytest
import torch

from numerics.cpu.forward import AttentionState, attend_chunks
from numerics.cpu.partials import Partials, chunk_partials, fold, kernel_fingerprint

pytestmark = pytest.mark.fused_kernel  # skips only where the CPU cannot run it

CHUNK = 256


def _problem(prefix_chunks: int, extra: int, tokens: int, heads: int, kv_heads: int, dim: int):
    g = torch.Generator().manual_seed(prefix_chunks * 1000 + extra * 10 + tokens)
    n = prefix_chunks * CHUNK + extra + tokens
    keys = torch.randn(kv_heads, n + CHUNK, dim, generator=g)
    values = torch.randn(kv_heads, n + CHUNK, dim, generator=g)
    q = (torch.randn(tokens, heads, dim, generator=g) * 0.3).contiguous()
    return q, keys, values, torch.arange(n - tokens, n)


def _chunks(t: torch.Tensor, count: int) -> list[torch.Tensor]:
    return [t[:, c * CHUNK : (c + 1) * CHUNK] for c in range(count)]


@pytest.mark.parametrize("prefix_chunks", [1, 2, 5])
@pytest.mark.parametrize("extra", [0, 7, 255, 300])
@pytest.mark.parametrize(
    "shape", [(1, 9, 3, 64), (5, 9, 3, 64), (8, 4, 4, 32), (3, 6, 2, 24)], ids=str
)
def test_remote_partials_folded_equal_local_attention(prefix_chunks, extra, shape):
    """Prefix chunks' partials (as a shard computes them) folded, then the rest walked
    locally: bitwise the one-call kernel, across chunk boundaries, row counts and GQA."""
    q, keys, values, positions = _problem(prefix_chunks, extra, *shape)
    reference = AttentionState.start(*q.shape)
    attend_chunks(q, keys, values, positions, reference, key_chunk=CHUNK, finish=True)

    state = AttentionState.start(*q.shape)
    parts = chunk_partials(q, _chunks(keys, prefix_chunks), _chunks(values, prefix_chunks))
    fold(state.m, state.l, state.acc, parts)
    attend_chunks(
        q, keys, values, positions, state, key_chunk=CHUNK, first_chunk=prefix_chunks, finish=True
    )
    assert torch.equal(state.acc, reference.acc)


def test_partials_split_across_holders_fold_in_order():
    """Chunks computed by different holders (any grouping) fold to the same bits, and stacked
    rows of several requests get each row's result alone."""
    q, keys, values, _ = _problem(4, 0, 6, 9, 3, 64)
    together = chunk_partials(q, _chunks(keys, 4), _chunks(values, 4))
    first = chunk_partials(q, _chunks(keys, 4)[:1], _chunks(values, 4)[:1])
    rest = chunk_partials(q, _chunks(keys, 4)[1:], _chunks(values, 4)[1:])
    alone = chunk_partials(q[2:3].contiguous(), _chunks(keys, 4), _chunks(values, 4))
    assert torch.equal(torch.cat([first.acc, rest.acc]), together.acc)
    assert torch.equal(torch.cat([first.m, rest.m]), together.m)
    assert torch.equal(alone.acc[:, 0], together.acc[:, 2])
    assert torch.equal(alone.l[:, 0], together.l[:, 2])


def test_folding_an_empty_partial_changes_nothing_and_never_makes_nan():
    q, keys, values, _ = _problem(2, 0, 2, 4, 2, 32)
    parts = chunk_partials(q, _chunks(keys, 2), _chunks(values, 2))
    empty = Partials(
        torch.full((1, 2, 4), float("-inf")), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4, 32)
    )
    state = AttentionState.start(2, 4, 32)
    fold(state.m, state.l, state.acc, empty)  # nothing into nothing: still the start state
    assert torch.isinf(state.m).all() and not state.l.any() and not state.acc.any()
    fold(state.m, state.l, state.acc, parts)
    reference = AttentionState.start(2, 4, 32)
    fold(reference.m, reference.l, reference.acc, parts)
    fold(state.m, state.l, state.acc, empty)
    assert torch.equal(state.acc, reference.acc) and not torch.isnan(state.acc).any()


def test_fingerprint_is_stable_and_names_the_kernel():
    first = kernel_fingerprint()
    kernel_fingerprint.cache_clear()
    assert kernel_fingerprint() == first and len(first) == 24


def test_bad_shapes_are_refused():
    q, keys, values, _ = _problem(2, 0, 2, 4, 2, 32)
    with pytest.raises(ValueError, match="one values tensor"):
        chunk_partials(q, _chunks(keys, 2), _chunks(values, 1))
    with pytest.raises(RuntimeError, match="every chunk must hold"):
        chunk_partials(q, [keys[:, :CHUNK], keys[:, :128]], [values[:, :CHUNK], values[:, :128]])
