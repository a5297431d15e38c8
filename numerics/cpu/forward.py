"""Numerical building blocks of the forward pass, in an exact and a fast flavour.

Exact-mode contract (DESIGN.md section 5): the result for one token is a deterministic
function of that token's inputs and the keys at positions <= its own, whatever else is
computed alongside. It rests on three facts that `decoder.selfcheck` proves at start-up:

- a matrix product's row does not depend on the other rows once the product is padded to a
  multiple of its row tile (`row_tile` for the linear layers, `attention_row_tile` for
  attention);
- attention scores and probabilities are computed per fixed key chunk of `key_chunk`
  absolute positions (masked keys contribute exact zeros; they must hold finite values);
- the per-chunk partial results are merged in position order by a sequential prefix sum,
  and each query reads the prefix that ends at its own chunk, so keys after it (absent or
  present) never enter its result.

Exact attention has two implementations with different bits: the fused C++ kernel
(`numerics.cpu.fused`, one pass per key chunk with an online softmax, each query row
computed on its own) and the torch one below (the fallback). `exact_kernel_id` names the
one a process uses; exact KV is stored and looked up under it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from numerics.cpu import fused as fused_ext

if TYPE_CHECKING:  # numerics import no decoder module at run time
    from decoder.config import RopeConfig

TORCH_KERNEL_ID = "torch-v1"


class Linear:
    """y = x @ W^T with the weight packed once for the platform's matrix kernels.

    With oneDNN (torch's mkldnn backend) the weight is reordered once into the kernel's
    blocked layout: no per-call packing, and on the development machines every row's
    result was independent of the number of rows, down to a single row (the self-check
    proves it wherever the runner starts). Without oneDNN it falls back to `F.linear`.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = _use_onednn()
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] -> [N, out]."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


def _use_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, d] -> [N, d]; row-wise, the same formula as Hugging Face's LlamaRMSNorm."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2I] (gate then up) -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RopeTable:
    """cos/sin of rotary embeddings, computed in fixed blocks of positions.

    Each block is computed with the same shapes whenever it is (re)built, so the value for a
    position never depends on how many positions were needed before.
    """

    BLOCK = 1024

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        self.inv_freq = _inv_freq(rope, head_dim)  # [D/2]
        self.cos = torch.empty(0, head_dim)
        self.sin = torch.empty(0, head_dim)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N] int64 -> (cos, sin), each [N, D]."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        while self.cos.shape[0] < need:
            self._grow()
        return self.cos[positions], self.sin[positions]

    def _grow(self) -> None:
        start = self.cos.shape[0]
        pos = torch.arange(start, start + self.BLOCK, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [BLOCK, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [BLOCK, D]
        self.cos = torch.cat([self.cos, emb.cos()])
        self.sin = torch.cat([self.sin, emb.sin()])


def _inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    low_wavelen = rope.original_max_positions / rope.low_freq_factor
    high_wavelen = rope.original_max_positions / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos/sin: [N, D] -> [N, heads, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass(frozen=True, slots=True)
class _QueryBlock:
    start: int
    end: int
    rows: int  # real query rows: tokens * group
    hidden: torch.Tensor  # [n_chunks - first_masked, padded, key_chunk] bool: key after row
    first_masked: int  # chunks before this one are visible to every real row
    last: torch.Tensor  # [padded] index of each row's own last key chunk
    n_chunks: int

    @property
    def padded(self) -> int:
        return self.last.shape[0]


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Index work of exact attention for one sequence's queries, shared by every layer."""

    blocks: tuple[_QueryBlock, ...]  # torch kernel only (empty with the fused kernel)
    key_chunk: int
    positions: torch.Tensor  # [T] int64, contiguous: each query's own position
    fused: bool  # run the fused kernel (else the torch one)

    @classmethod
    def build(
        cls,
        q_pos: torch.Tensor,
        group: int,
        *,
        key_chunk: int,
        row_tile: int,
        query_block: int,
        fused: bool = False,
    ) -> AttentionPlan:
        """q_pos: [T] absolute positions of the queries; `group` query heads per kv head."""
        positions = q_pos.to(torch.long).contiguous()
        if fused:
            return cls((), key_chunk, positions, True)
        blocks = []
        for start in range(0, q_pos.shape[0], query_block):
            end = min(q_pos.shape[0], start + query_block)
            rows = (end - start) * group
            row_pos = torch.zeros(_ceil_to(rows, row_tile), dtype=torch.long)
            row_pos[:rows] = q_pos[start:end].repeat_interleave(group)
            n_chunks = int(q_pos[start:end].max()) // key_chunk + 1
            first = int(q_pos[start:end].min()) // key_chunk
            keys = torch.arange(first * key_chunk, n_chunks * key_chunk)
            hidden = (keys[None, :] > row_pos[:, None]).view(-1, n_chunks - first, key_chunk)
            blocks.append(
                _QueryBlock(
                    start,
                    end,
                    rows,
                    hidden.transpose(0, 1).contiguous(),
                    first,
                    row_pos // key_chunk,
                    n_chunks,
                )
            )
        return cls(tuple(blocks), key_chunk, positions, False)


def fused_kernel(head_dim: int) -> ModuleType | None:
    """The fused exact-attention kernel when it serves this head size (a multiple of 8) on
    this machine, else None: exact mode then uses the torch implementation."""
    if head_dim % 8:
        return None
    return fused_ext.module()


def exact_kernel_id(head_dim: int) -> str:
    """Names the exact-attention implementation this process uses for `head_dim`.

    Exact KV computed by one implementation is not bitwise that of another, so a decoder
    must verify only against KV made by its own: the id is part of the identity under which
    exact KV is stored and looked up (`decoder.store_source.kv_layout`). The fused kernel's
    id carries a digest of its source and compiler flags, so any change to its arithmetic
    gives a new id (a miss, never a wrong hit).
    """
    if fused_kernel(head_dim) is None:
        return TORCH_KERNEL_ID
    return f"fused-avx2-{fused_ext.source_digest()[:12]}"


@dataclass(frozen=True, slots=True)
class AttentionState:
    """Online-softmax state of query rows part-way through their keys (fused kernel).

    m [T, H]: running max of the scores seen; l [T, H]: running sum of exp(score - m);
    acc [T, H, D]: running sum of exp(score - m) * value. Token-major, so the rows of a
    run of tokens (`tokens(start, end)`) are a contiguous view of the state.
    """

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 - the softmax denominator's usual name
    acc: torch.Tensor

    @classmethod
    def start(cls, tokens: int, heads: int, dim: int) -> AttentionState:
        """The state before any key: m = -inf, l = 0, acc = 0."""
        return cls(
            torch.full((tokens, heads), float("-inf")),
            torch.zeros(tokens, heads),
            torch.zeros(tokens, heads, dim),
        )

    def tokens(self, start: int, end: int) -> AttentionState:
        """A view of the rows of tokens [start, end)."""
        return AttentionState(self.m[start:end], self.l[start:end], self.acc[start:end])


def attend_chunks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    state: AttentionState,
    *,
    key_chunk: int,
    first_chunk: int = 0,
    stop_chunk: int | None = None,
    finish: bool = False,
) -> None:
    """Fused kernel: walk key chunks [first_chunk, stop_chunk) of every query, in place.

    Each query sees the keys of those chunks up to its own position. With `finish`,
    state.acc becomes the attention output (acc / l). A query's result after walking its
    chunks over several calls, or beside any other queries, is bitwise the result of one
    call over all its chunks alone.
    q: [T, H, D] contiguous, rotated and scaled; keys, values: [KVH, capacity, D], slot j
    holding position j (dense within each head); positions: [T] int64 contiguous.
    """
    module = fused_kernel(q.shape[-1])
    if module is None:
        raise RuntimeError("the fused exact-attention kernel is not available")
    stop = -1 if stop_chunk is None else stop_chunk
    module.attend(
        q,
        keys,
        values,
        positions,
        state.m,
        state.l,
        state.acc,
        key_chunk,
        first_chunk,
        stop,
        finish,
    )


def exact_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan
) -> torch.Tensor:
    """Causal attention whose per-query result is independent of grouping and future keys.

    q: [T, H, D], already rotated and multiplied by the softmax scale.
    keys, values: [KVH, capacity, D] where slot j holds absolute position j (a dense cache
        from position 0); capacity is a multiple of key_chunk and every slot holds finite
        values (unused slots are masked, never read as NaN).
    plan: built from the queries' positions; every key at a position <= a query's own
        position must be present. `plan.fused` runs the fused kernel (which reads only
        those keys), else the torch implementation below.
    Returns [T, H, D].
    """
    if plan.fused:
        q = q.contiguous()
        state = AttentionState.start(*q.shape)
        attend_chunks(q, keys, values, plan.positions, state, key_chunk=plan.key_chunk, finish=True)
        return state.acc
    out = torch.empty_like(q)
    for block in plan.blocks:
        out[block.start : block.end] = _exact_attention_block(
            q[block.start : block.end], keys, values, block, plan.key_chunk
        )
    return out


def _exact_attention_block(q, keys, values, block: _QueryBlock, key_chunk: int):
    t, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    rows, padded, n_chunks = block.rows, block.padded, block.n_chunks
    n_keys = n_chunks * key_chunk
    # qr: [KVH, padded, D]; row r is token r // group, query head (r % group) of the kv head.
    qr = q.new_zeros(kv_heads, padded, dim)
    qr[:, :rows] = q.view(t, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, rows, dim)

    # Scores per key chunk with fixed shapes: [KVH, n_chunks, padded, key_chunk].
    chunked_keys = keys[:, :n_keys].view(kv_heads, n_chunks, key_chunk, dim)
    scores = torch.matmul(qr.unsqueeze(1), chunked_keys.transpose(2, 3))
    # Only chunks that reach past some row's own position need the causal mask.
    scores[:, block.first_masked :].masked_fill_(block.hidden, float("-inf"))
    chunk_max = scores.amax(-1)  # [KVH, n_chunks, padded]
    safe_max = chunk_max.masked_fill(chunk_max == float("-inf"), 0.0)
    probs = scores.sub_(safe_max.unsqueeze(-1)).exp_()  # masked keys -> exactly 0
    chunk_sum = probs.sum(-1)  # [KVH, n_chunks, padded]
    chunk_out = torch.matmul(  # [KVH, n_chunks, padded, D]
        probs, values[:, :n_keys].view(kv_heads, n_chunks, key_chunk, dim)
    )

    # Merge chunks in position order: prefix sums, read at each row's own last chunk.
    row_max = chunk_max.amax(1, keepdim=True)  # [KVH, 1, padded]
    weight = torch.exp(chunk_max - row_max)  # [KVH, n_chunks, padded]
    numer = torch.cumsum(chunk_out * weight.unsqueeze(-1), dim=1)
    denom = torch.cumsum(chunk_sum * weight, dim=1)
    row = torch.arange(padded)
    merged = numer[:, block.last, row] / denom[:, block.last, row].unsqueeze(-1)  # [KVH, padded, D]
    return merged[:, :rows].view(kv_heads, t, group, dim).permute(1, 0, 2, 3).reshape(t, heads, dim)


def fast_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention over keys at arbitrary positions, with torch's fused kernel.

    q: [T, H, D] rotated, not scaled; keys/values: [KVH, N, D]; q_pos: [T]; k_pos: [N], or
    [KVH, N] when each kv head keeps its own positions (token-dropping compressors).
    Every key must be at a position <= the last query's (the cache holds nothing later).
    Returns [T, H, D]. No exactness guarantee: for drafting.
    """
    mask = None  # one query sees every cached key (its own is the last): no mask needed
    if q_pos.shape[0] > 1:
        mask = k_pos[..., None, :] <= q_pos[:, None]  # [T, N] or [KVH, T, N]
        if mask.dim() == 3:
            mask = mask.repeat_interleave(q.shape[1] // keys.shape[0], dim=0)  # [H, T, N]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, T, D]
    return out[0].transpose(0, 1)


def fast_attention_lse(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of equal-headed batches with its log-sum-exp, so that attention over two
    disjoint key sets can be merged (`merge_attention`): torch's fused CPU kernel.

    q: [B, N, T, D], keys/values: [B, N, S, D], mask: additive float [B, 1, T, S] or None.
    Returns (out [B, N, T, D], lse [B, N, T]). A row whose every key is masked gets 0 and
    lse 0: callers never read such rows. No exactness guarantee: for drafting.
    """
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, values, 0.0, False, attn_mask=mask, scale=scale
    )
    return out, lse


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each one's (out [..., D],
    lse [...]) (online-softmax rescaling)."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - lse), torch.exp(lse_b - lse)
    return out_a * weight_a.unsqueeze(-1) + out_b * weight_b.unsqueeze(-1)


def _ceil_to(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n and >= multiple (`decoder.config.ceil_to`)."""
    return max(multiple, math.ceil(n / multiple) * multiple)
