"""Near-data attention: attention partials computed where the KV lives.

A verification pass need not pull a prefix's full KV: exact attention folds per-chunk
partials in position order (DESIGN.md section 5), so a shard holding a chunk can compute
that chunk's partial for the pass's query rows and return it, and the decoder folds the
partials of every chunk, in order, with the same kernel code. The result is bitwise the
decoder's own kernel over the same keys (`chunk_partials` then `fold` == one `attend`).
Shards need no model weights: only this kernel and the stored bytes.

Exactness across hosts rests on every party running the same kernel binary's arithmetic:
`kernel_fingerprint()` runs fixed test vectors through it and hashes the results; a decoder
offloads only to shards advertising its own fingerprint, and pulls otherwise.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

from numerics.cpu import fused

__all__ = ["Partials", "chunk_partials", "fold", "kernel_fingerprint"]


@dataclass(frozen=True, slots=True)
class Partials:
    """Per-chunk attention partials of query rows, chunks in position order.

    m [C, T, H]: the chunk's max score per row; l [C, T, H]: sum of exp(score - m);
    acc [C, T, H, D]: sum of exp(score - m) * value.
    """

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 - the softmax denominator's usual name
    acc: torch.Tensor

    @classmethod
    def empty(cls, chunks: int, tokens: int, heads: int, dim: int) -> Partials:
        return cls(
            torch.empty(chunks, tokens, heads),
            torch.empty(chunks, tokens, heads),
            torch.empty(chunks, tokens, heads, dim),
        )

    @property
    def chunks(self) -> int:
        return self.m.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.m, self.l, self.acc))


def available() -> bool:
    """Whether this process runs the fused kernel (near-data attention needs it)."""
    return fused.module() is not None


def _module():
    module = fused.module()
    if module is None:
        raise RuntimeError("near-data attention needs the fused exact-attention kernel")
    return module


def chunk_partials(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> Partials:
    """Each chunk's partial for every query row, every key visible to every row.

    q [T, H, D] float32 contiguous, rotated and scaled; keys[c], values[c] [KVH, n, D]
    float32, dense within each head, n the same for every chunk (a multiple of 8); H a
    multiple of KVH, D a multiple of 8.
    """
    if not keys or len(keys) != len(values):
        raise ValueError("chunk_partials needs one values tensor per keys tensor, at least one")
    out = Partials.empty(len(keys), *q.shape)
    _module().partials(q, list(keys), list(values), keys[0].shape[1], out.m, out.l, out.acc)
    return out


def fold(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, partials: Partials) -> None:  # noqa: E741
    """Fold `partials` (chunks in position order) into online-softmax state in place:
    m, l [T, H], acc [T, H, D], contiguous (start: -inf, 0, 0), exactly as the kernel folds
    the chunks it walks itself."""
    _module().fold(m, l, acc, partials.m, partials.l, partials.acc)


@functools.cache
def kernel_fingerprint() -> str:
    """A digest of the kernel's arithmetic on fixed test vectors ("" without the kernel).

    Two processes with equal fingerprints compute bitwise-equal partials and folds on these
    vectors; the fingerprint also names the source digest, so a rebuilt kernel with other
    arithmetic never matches by chance.
    """
    if not available():
        return ""
    h = hashlib.sha256(fused.source_digest().encode())
    for heads, kv_heads, dim, tokens in ((4, 2, 64, 5), (3, 1, 24, 2)):
        q = _vector((tokens, heads, dim), 1)
        keys = [_vector((kv_heads, 256, dim), 2 + c) for c in range(3)]
        values = [_vector((kv_heads, 256, dim), 7 + c) for c in range(3)]
        parts = chunk_partials(q, keys, values)
        m = torch.full((tokens, heads), float("-inf"))
        l = torch.zeros(tokens, heads)  # noqa: E741
        acc = torch.zeros(tokens, heads, dim)
        fold(m, l, acc, parts)
        for t in (parts.m, parts.l, parts.acc, m, l, acc):
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return f"{h.hexdigest()[:24]}"


def _vector(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic float32 values in [-1, 1) from integer arithmetic (no RNG involved)."""
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    x = (i * 2654435761 + seed * 40503) % 65521
    return (x.to(torch.float32) / 32760.5 - 1.0).reshape(shape).contiguous()
