"""The exact-mode Triton kernels (numerics.gpu), on CPU under Triton's interpreter (on a
GPU where there is one): they compute what the CPU's building blocks compute, and a row's
result is bitwise the same whatever the number of rows in the call and whatever the other
rows hold."""

from __future__ import annotations

import os

import pytest
import torch

from numerics.cpu.forward import rms_norm as cpu_rms_norm
from numerics.gpu import Tiles, kernel_id

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it
    pytest.skip("no GPU, and Triton's interpreter is off", allow_module_level=True)
kernels = pytest.importorskip("numerics.gpu.kernels", reason="Triton is not installed")

DEVICE = "cuda" if CUDA else "cpu"
TILES = Tiles(block_m=16, block_n=16, block_k=16)
"""Small tiles, so that small shapes span several tiles in every direction (and the
interpreter, which runs each program in numpy, stays quick)."""
ROWS = (1, 3, 16, 17, 40)
"""One row, a part of a tile, a whole tile, one past it, and several tiles."""


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _linear_inputs(m: int = 40, k: int = 72, n: int = 40):
    """K and N not multiples of the tiles: the masks at both edges are exercised."""
    g = _generator()
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    return x.to(DEVICE), w.to(DEVICE)


def test_linear_computes_x_times_the_weight_transposed():
    x, w = _linear_inputs()
    got = kernels.linear(x, w, TILES)
    assert got.shape == (40, 40) and got.dtype == x.dtype
    torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_a_linear_row_is_the_same_bits_in_any_batch(rows):
    x, w = _linear_inputs()
    alone = torch.cat([kernels.linear(x[i : i + 1], w, TILES) for i in range(rows)])
    together = kernels.linear(x[:rows], w, TILES)
    assert torch.equal(together, alone)


def test_a_linear_row_does_not_depend_on_the_other_rows():
    x, w = _linear_inputs()
    other = x.clone()
    other[1:] = torch.randn(other[1:].shape, generator=_generator()).to(DEVICE) * 100
    assert torch.equal(kernels.linear(x, w, TILES)[0], kernels.linear(other, w, TILES)[0])


def test_linear_refuses_mismatched_shapes():
    x, w = _linear_inputs()
    with pytest.raises(ValueError, match="x has 72 columns, the weight 71"):
        kernels.linear(x, w[:, :71], TILES)


def _norm_inputs(n: int = 40, d: int = 48):
    """d not a power of two: the block's masked tail is exercised."""
    g = _generator()
    return torch.randn(n, d, generator=g).to(DEVICE), torch.randn(d, generator=g).to(DEVICE)


def test_rms_norm_computes_the_cpu_formula():
    x, weight = _norm_inputs()
    torch.testing.assert_close(
        kernels.rms_norm(x, weight, 1e-5), cpu_rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("rows", ROWS)
def test_an_rms_norm_row_is_the_same_bits_in_any_batch(rows):
    x, weight = _norm_inputs()
    alone = torch.cat([kernels.rms_norm(x[i : i + 1], weight, 1e-5) for i in range(rows)])
    assert torch.equal(kernels.rms_norm(x[:rows], weight, 1e-5), alone)


def test_the_kernel_id_names_the_source_and_the_tiles(tmp_path, monkeypatch):
    import numerics.gpu as gpu

    assert kernel_id(TILES) != kernel_id(Tiles())
    assert kernel_id(TILES).startswith("triton-")
    edited = tmp_path / "kernels.py"
    edited.write_bytes(gpu.KERNELS_SOURCE.read_bytes() + b"# a comment\n")
    before = kernel_id(TILES)
    monkeypatch.setattr(gpu, "KERNELS_SOURCE", edited)
    assert kernel_id(TILES) != before


@pytest.mark.parametrize("field", ["block_m", "block_n", "block_k"])
@pytest.mark.parametrize("value", [8, 48])
def test_tiles_must_be_powers_of_two_of_at_least_16(field, value):
    with pytest.raises(ValueError, match=f"Tiles.{field}: {value} is not a power of two >= 16"):
        Tiles(**{field: value})


CHUNK = 16
"""Small key chunks, so that short sequences span several."""


def _attention_inputs(n: int = 6, heads: int = 4, kv_heads: int = 2, length: int = 70, d: int = 24):
    """d not a power of two and length not a multiple of the chunk: the masks at both edges
    are exercised; query heads share kv heads (GQA)."""
    g = _generator()
    q = torch.randn(n, heads, d, generator=g)
    k, v = (torch.randn(kv_heads, length, d, generator=g) for _ in range(2))
    positions = torch.tensor([0, 5, 15, 16, 40, 69][:n])
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), positions.to(DEVICE)


def _reference(q, k, v, positions, scale):
    group = q.shape[1] // k.shape[0]
    out = torch.empty_like(q)
    for row, pos in enumerate(positions.tolist()):
        for head in range(q.shape[1]):
            keys, values = k[head // group, : pos + 1], v[head // group, : pos + 1]
            weights = torch.softmax(keys @ q[row, head] * scale, dim=0)
            out[row, head] = weights @ values
    return out


def test_attention_is_causal_softmax_attention_over_the_rows_positions():
    q, k, v, positions = _attention_inputs()
    got = kernels.attention(q, k, v, positions, 0.2, key_chunk=CHUNK)
    torch.testing.assert_close(got, _reference(q, k, v, positions, 0.2), rtol=1e-5, atol=1e-5)


def test_an_attention_row_is_the_same_bits_alone_in_any_batch_and_over_any_later_keys():
    q, k, v, positions = _attention_inputs()
    together = kernels.attention(q, k, v, positions, 0.2, key_chunk=CHUNK)
    for row, pos in enumerate(positions.tolist()):
        one = slice(row, row + 1)
        alone = kernels.attention(q[one], k, v, positions[one], 0.2, key_chunk=CHUNK)
        assert torch.equal(alone, together[one])
        # the keys after its position absent, or holding anything at all (NaN included)
        cut = kernels.attention(
            q[one], k[:, : pos + 1], v[:, : pos + 1], positions[one], 0.2, key_chunk=CHUNK
        )
        later_k, later_v = k.clone(), v.clone()
        later_k[:, pos + 1 :], later_v[:, pos + 1 :] = float("nan"), float("inf")
        poisoned = kernels.attention(q[one], later_k, later_v, positions[one], 0.2, key_chunk=CHUNK)
        assert torch.equal(cut, together[one]) and torch.equal(poisoned, together[one])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q[..., :8], k, v), "q \\(6, 4, 8\\), k \\(2, 70, 24\\)"),
        (lambda q, k, v: (q[:, :3], k, v), "3 query heads over 2 kv heads"),
    ],
)
def test_attention_refuses_mismatched_shapes(change, message):
    q, k, v, positions = _attention_inputs()
    with pytest.raises(ValueError, match=message):
        kernels.attention(*change(q, k, v), positions, 0.2, key_chunk=CHUNK)


def test_attention_refuses_a_key_chunk_that_is_not_a_power_of_two():
    q, k, v, positions = _attention_inputs()
    with pytest.raises(ValueError, match="key_chunk 24 is not a power of two >= 16"):
        kernels.attention(q, k, v, positions, 0.2, key_chunk=24)


def _rope_inputs(n: int = 9, heads: int = 3, d: int = 24):
    """Neither the heads nor half the head size a power of two: the masks are exercised."""
    g = _generator()
    x = torch.randn(n, heads, d, generator=g)
    angles = torch.arange(n)[:, None] * torch.rand(d // 2, generator=g)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)


def test_rope_computes_the_cpu_rotation():
    from numerics.cpu.forward import apply_rope

    x, cos, sin = _rope_inputs()
    torch.testing.assert_close(kernels.rope(x, cos, sin), apply_rope(x, cos, sin))


def test_a_rope_token_is_the_same_bits_in_any_batch():
    x, cos, sin = _rope_inputs()
    together = kernels.rope(x, cos, sin)
    alone = torch.cat(
        [kernels.rope(x[i : i + 1], cos[i : i + 1], sin[i : i + 1]) for i in range(9)]
    )
    assert torch.equal(together, alone)


def test_rope_refuses_an_odd_head_size_or_angles_of_another_shape():
    x, cos, sin = _rope_inputs()
    with pytest.raises(ValueError, match="rope: x \\(9, 3, 23\\)"):
        kernels.rope(x[..., :23], cos[:, :23], sin[:, :23])
    with pytest.raises(ValueError, match="cos \\(8, 24\\)"):
        kernels.rope(x, cos[:8], sin)
