"""Exact-mode Triton kernels: a linear layer and RMSNorm whose rows are batch-invariant.

Each output element is reduced in one fixed order that depends on nothing but its own row:
the linear layer steps over K in `Tiles.block_k` columns, in order, into an fp32
accumulator (no split-K, one tile configuration for every call); RMSNorm sums a row's
squares over one block of the next power of two of its width. Inputs are bf16 on a GPU
(fp32 under the interpreter in the tests); accumulation is always fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from numerics.gpu import DEFAULT_TILES, Tiles


@triton.jit
def _linear_kernel(
    x, w, y, m, n, k,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MMA: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of y = x @ w^T (x: [m, k], w: [n, k], rows contiguous).
    MMA: each step's product by `tl.dot` (a GPU's matrix units); else by an elementwise
    product summed over the step (see `linear`)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + steps
        a = tl.load(
            x + rows[:, None] * stride_xm + ks[None, :],
            mask=(rows[:, None] < m) & (ks[None, :] < k),
            other=0.0,
        )
        b = tl.load(
            w + cols[None, :] * stride_wn + ks[:, None],
            mask=(cols[None, :] < n) & (ks[:, None] < k),
            other=0.0,
        )
        if MMA:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    out = y + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=(rows[:, None] < m) & (cols[None, :] < n))


def linear(x: torch.Tensor, weight: torch.Tensor, tiles: Tiles = DEFAULT_TILES) -> torch.Tensor:
    """x: [M, K] -> [M, N] = x @ weight^T (weight: [N, K]), in x's dtype; row i of the
    result depends on x[i] and the weight only (bitwise, for every M).

    On a GPU each step is a `tl.dot`, whose matrix instructions compute every row of a tile
    alike. Under Triton's interpreter (CPU tensors) `tl.dot` is numpy's matmul, whose BLAS
    micro-kernels round a row differently by its place in the tile, so there each step is
    an elementwise product summed over K instead: the same tiles, masks and order."""
    m, k = x.shape
    n, k_w = weight.shape
    if k != k_w:
        raise ValueError(f"linear: x has {k} columns, the weight {k_w}")
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _linear_kernel[grid](
        x, weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, MMA=x.is_cuda,
    )  # fmt: skip
    return y


@triton.jit
def _rms_norm_kernel(x, weight, y, d, stride, eps, BLOCK: tl.constexpr):
    """One row: y = weight * (x * rsqrt(mean(x^2) + eps)), in fp32, stored in y's dtype."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    v = tl.load(x + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / d + eps)
    g = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row * stride + cols, (g * (v * inv)).to(y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, d] -> [N, d], row by row (Hugging Face's LlamaRMSNorm formula, in fp32)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    d = x.shape[1]
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(x.shape[0],)](x, weight, y, d, x.stride(0), eps, BLOCK=block)
    return y
