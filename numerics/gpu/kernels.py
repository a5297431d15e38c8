"""Exact-mode Triton kernels: a linear layer, RMSNorm and causal attention whose rows are
batch-invariant.

Each output element is reduced in one fixed order that depends on nothing but its own row:
the linear layer steps over K in `Tiles.block_k` columns, in order, into an fp32
accumulator (no split-K, one tile configuration for every call); RMSNorm sums a row's
squares over one block of the next power of two of its width; attention folds a row's key
chunks in position order and stops at its own. Inputs are bf16 on a GPU
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


@triton.jit
def _attention_kernel(
    q, k, v, out, positions, length, scale,
    stride_qn, stride_qh, stride_kh, stride_kt, stride_on, stride_oh,
    GROUP: tl.constexpr, CHUNK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One query row of one head: its keys in chunks of CHUNK absolute positions, from the
    first up to the chunk that holds its own position, each reduced on its own and folded
    into the running (max, sum, output) in position order. Keys after its position are
    never loaded."""
    row, head = tl.program_id(0), tl.program_id(1)
    kv = head // GROUP
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    pos = tl.load(positions + row)
    last = tl.minimum(pos, length - 1)
    qv = tl.load(q + row * stride_qn + head * stride_qh + dims, mask=dmask, other=0.0)
    qv = qv.to(tl.float32) * scale
    m = tl.full((), -float("inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for chunk in range(0, last // CHUNK + 1):
        keys = chunk * CHUNK + tl.arange(0, CHUNK)
        kmask = keys <= last
        at = kv * stride_kh + keys[:, None] * stride_kt + dims[None, :]
        both = kmask[:, None] & dmask[None, :]
        kc = tl.load(k + at, mask=both, other=0.0).to(tl.float32)
        scores = tl.where(kmask, tl.sum(kc * qv[None, :], axis=1), -float("inf"))
        m_chunk = tl.max(scores, axis=0)
        p = tl.exp(scores - m_chunk)
        vc = tl.load(v + at, mask=both, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, m_chunk)
        keep, take = tl.exp(m - m_new), tl.exp(m_chunk - m_new)
        total = total * keep + tl.sum(p, axis=0) * take
        acc = acc * keep + tl.sum(p[:, None] * vc, axis=0) * take
        m = m_new
    o = out + row * stride_on + head * stride_oh + dims
    tl.store(o, (acc / total).to(out.dtype.element_ty), mask=dmask)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    key_chunk: int = 256,
) -> torch.Tensor:
    """Exact causal attention of query rows over one sequence's keys.

    q: [N, H, D]; k, v: [KVH, T, D], slot t holding position t; positions: [N], each row's
    absolute position (it attends the keys at positions up to its own that the T slots
    hold). Returns [N, H, D] in q's dtype. A row's result depends on its query, its
    position and those keys only: not on the other rows, N, T beyond its position, or what
    the slots after it hold (they are never read)."""
    n, heads, d = q.shape
    kv_heads, length, d_k = k.shape
    if d_k != d or v.shape != k.shape:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if heads % kv_heads:
        raise ValueError(f"attention: {heads} query heads over {kv_heads} kv heads")
    if key_chunk < 16 or key_chunk & (key_chunk - 1):
        raise ValueError(f"attention: key_chunk {key_chunk} is not a power of two >= 16")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    positions = positions.to(device=q.device, dtype=torch.int64).contiguous()
    out = torch.empty_like(q)
    _attention_kernel[(n, heads)](
        q, k, v, out, positions, length, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, CHUNK=key_chunk, D=d, BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip
    return out
