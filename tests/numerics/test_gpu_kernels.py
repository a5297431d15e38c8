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
if not CUDA:  # read when the kernels are decorated: set before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
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
