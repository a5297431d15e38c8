"""Exact-mode Triton kernels: a linear layer, RMSNorm, RoPE and causal attention whose rows
are batch-invariant.

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

from numerics.gpu import DEFAULT_TILES, Tiles, block_size


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
def _chunk_partials_kernel(
    q, k, v, m_out, l_out, o_out, positions, length, scale,
    stride_qn, stride_qh, stride_kh, stride_kt, stride_pn, stride_ph, stride_on, stride_oh,
    stride_oc, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, MMA: tl.constexpr,
):  # fmt: skip
    """One key chunk of one query row, for the GROUP query heads of one kv head: the chunk's
    max score, sum of exponentials and weighted values (nothing for a chunk after the
    row's own: the fold never reads it). Keys after the row's position are never loaded."""
    row, kv, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    last = tl.minimum(tl.load(positions + row), length - 1)
    if chunk <= last // CHUNK:
        heads = kv * GROUP + tl.arange(0, GROUP_PAD)
        hmask = tl.arange(0, GROUP_PAD) < GROUP
        dims = tl.arange(0, BLOCK_D)
        dmask = dims < D
        keys = chunk * CHUNK + tl.arange(0, CHUNK)
        kmask = keys <= last
        qs = (
            tl.load(
                q + row * stride_qn + heads[:, None] * stride_qh + dims[None, :],
                mask=hmask[:, None] & dmask[None, :],
                other=0.0,
            ).to(tl.float32)
            * scale
        )
        at = kv * stride_kh + keys[:, None] * stride_kt + dims[None, :]
        both = kmask[:, None] & dmask[None, :]
        kc = tl.load(k + at, mask=both, other=0.0).to(tl.float32)
        vc = tl.load(v + at, mask=both, other=0.0).to(tl.float32)
        if MMA:
            scores = tl.dot(qs, tl.trans(kc), input_precision="ieee")
        else:
            scores = tl.sum(qs[:, None, :] * kc[None, :, :], axis=2)
        scores = tl.where(kmask[None, :], scores, -float("inf"))
        m = tl.max(scores, axis=1)
        p = tl.exp(scores - m[:, None])
        total = tl.sum(p, axis=1)
        if MMA:
            o = tl.dot(p, vc, input_precision="ieee")
        else:
            o = tl.sum(p[:, :, None] * vc[None, :, :], axis=1)
        at_p = row * stride_pn + heads * stride_ph + chunk
        tl.store(m_out + at_p, m, mask=hmask)
        tl.store(l_out + at_p, total, mask=hmask)
        at_o = row * stride_on + heads[:, None] * stride_oh + chunk * stride_oc + dims[None, :]
        tl.store(o_out + at_o, o, mask=hmask[:, None] & dmask[None, :])


@triton.jit
def _fold_kernel(
    m_in, l_in, o_in, out, positions, length,
    stride_pn, stride_ph, stride_on, stride_oh, stride_oc, stride_yn, stride_yh,
    CHUNK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One query row of one head: its chunks' partials folded in position order, from the
    first chunk to its own."""
    row, head = tl.program_id(0), tl.program_id(1)
    last = tl.minimum(tl.load(positions + row), length - 1)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < D
    m = tl.full((), -float("inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    base = row * stride_pn + head * stride_ph
    for chunk in range(0, last // CHUNK + 1):
        m_chunk = tl.load(m_in + base + chunk)
        o_chunk = tl.load(
            o_in + row * stride_on + head * stride_oh + chunk * stride_oc + dims,
            mask=dmask,
            other=0.0,
        )
        m_new = tl.maximum(m, m_chunk)
        keep, take = tl.exp(m - m_new), tl.exp(m_chunk - m_new)
        total = total * keep + tl.load(l_in + base + chunk) * take
        acc = acc * keep + o_chunk * take
        m = m_new
    y = out + row * stride_yn + head * stride_yh + dims
    tl.store(y, (acc / total).to(out.dtype.element_ty), mask=dmask)


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
    the slots after it hold (they are never read).

    Two launches: every (row, kv head, chunk) computes its chunk's partials (max, sum,
    weighted values; the query heads of a kv head together, so each chunk's keys and values
    are read once for them), all in parallel; then every (row, head) folds its partials in
    position order. On a GPU the chunk's products are `tl.dot`s; under Triton's interpreter
    (CPU tensors), elementwise products summed, as in `linear`. The partials take
    N x H x ceil(T / key_chunk) x (D + 2) fp32 scratch: 70 MB for a 33-row verify pass over
    32K keys at 32 x 128 heads, so a caller splits a long prefill into row blocks (a row's
    bits do not depend on its block)."""
    n, heads, d = q.shape
    kv_heads, length, d_k = k.shape
    if d_k != d or v.shape != k.shape:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if heads % kv_heads:
        raise ValueError(f"attention: {heads} query heads over {kv_heads} kv heads")
    if not block_size(key_chunk):
        raise ValueError(f"attention: key_chunk {key_chunk} is not a power of two >= 16")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    positions = positions.to(device=q.device, dtype=torch.int64).contiguous()
    chunks = triton.cdiv(length, key_chunk)
    group, block_d = heads // kv_heads, triton.next_power_of_2(d)
    m = torch.empty(n, heads, chunks, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    o = torch.empty(n, heads, chunks, d, dtype=torch.float32, device=q.device)
    _chunk_partials_kernel[(n, kv_heads, chunks)](
        q, k, v, m, total, o, positions, length, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), m.stride(0), m.stride(1),
        o.stride(0), o.stride(1), o.stride(2),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), CHUNK=key_chunk,
        D=d, BLOCK_D=block_d, MMA=q.is_cuda,
    )  # fmt: skip
    out = torch.empty_like(q)
    _fold_kernel[(n, heads)](
        m, total, o, out, positions, length,
        m.stride(0), m.stride(1), o.stride(0), o.stride(1), o.stride(2),
        out.stride(0), out.stride(1),
        CHUNK=key_chunk, D=d, BLOCK_D=block_d,
    )  # fmt: skip
    return out


@triton.jit
def _rope_kernel(
    x, cos, sin, y, heads, half, stride_xn, stride_xh, stride_cn,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """One token's heads: y = x * cos + rotate_half(x) * sin (rotate_half: [-x2, x1])."""
    row = tl.program_id(0)
    hs = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < half
    mask = (hs[:, None] < heads) & dmask[None, :]
    at = row * stride_xn + hs[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + at + half, mask=mask, other=0.0).to(tl.float32)
    angle = row * stride_cn + dims
    c1 = tl.load(cos + angle, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos + angle + half, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin + angle, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin + angle + half, mask=dmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y + at, (x1 * c1 - x2 * s1).to(y.dtype.element_ty), mask=mask)
    tl.store(y + at + half, (x2 * c2 + x1 * s2).to(y.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos/sin: [N, D] -> [N, heads, D], the rotate-half convention of
    `numerics.cpu.forward.apply_rope`, token by token (D even)."""
    n, heads, d = x.shape
    if d % 2 or cos.shape != (n, d) or sin.shape != (n, d):
        raise ValueError(
            f"rope: x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    _rope_kernel[(n,)](
        x, cos, sin, y, heads, d // 2, x.stride(0), x.stride(1), cos.stride(0),
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_HALF=triton.next_power_of_2(d // 2),
    )  # fmt: skip
    return y
