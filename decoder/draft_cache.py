"""The drafter's view of a request: the compressed prefix plus the request's tail.

The tail part mirrors the request's exact tail (verified KV) and, during a draft round,
the drafted tokens' own KV; after verification the drafted rows are rolled back and the
accepted tokens' verified KV is copied in (DESIGN.md section 4).

An unquantized compressed prefix is copied once into the layer's buffer, in front of the
tail, so a draft step attends over views. A quantized prefix stays packed and is decoded
at every draft step: its memory saving is real, and so is the decoding cost.
"""

from __future__ import annotations

import torch

from decoder.compressors import CompressedKV, CompressedLayer
from decoder.kv_cache import KVCache


class DraftLayer:
    """One layer: compressed prefix slots, then tail slots, positions per kv head."""

    def __init__(
        self, prefix: CompressedLayer, tail_capacity: int, kv_heads: int, head_dim: int
    ) -> None:
        self.prefix = prefix
        self.resident = not prefix.quantized
        self.base = prefix.kept if self.resident else 0
        cap = self.base + max(1, tail_capacity)
        self.k = torch.zeros(kv_heads, cap, head_dim)
        self.v = torch.zeros(kv_heads, cap, head_dim)
        self.positions = torch.zeros(kv_heads, cap, dtype=torch.long)
        if self.resident:
            k, v = prefix.materialize()
            self.k[:, : self.base], self.v[:, : self.base] = k, v
            self.positions[:, : self.base] = prefix.positions
        self.tail_length = 0

    @property
    def nbytes(self) -> int:
        """Resident bytes: the buffers (prefix copy and tail room) plus a packed prefix."""
        own = 2 * self.k.numel() * self.k.element_size()
        return own + (0 if self.resident else self.prefix.nbytes)

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v: [KVH, t, D]; positions: [t] (the same for every head)."""
        start = self.base + self.tail_length
        end = start + positions.shape[0]
        if end > self.k.shape[1]:
            self._grow(end)
        self.k[:, start:end], self.v[:, start:end] = k, v
        self.positions[:, start:end] = positions
        self.tail_length += positions.shape[0]

    def live(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        end = self.base + self.tail_length
        k, v, pos = self.k[:, :end], self.v[:, :end], self.positions[:, :end]
        if self.resident:
            return k, v, pos
        pk, pv = self.prefix.materialize()
        return (
            torch.cat([pk, k], dim=1),
            torch.cat([pv, v], dim=1),
            torch.cat([self.prefix.positions.long(), pos], dim=1),
        )

    def truncate(self, tail_length: int) -> None:
        self.tail_length = tail_length

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * self.k.shape[1])
        for name in ("k", "v", "positions"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], cap, *old.shape[2:])
            grown[:, : old.shape[1]] = old
            setattr(self, name, grown)


class DraftCache:
    """A request's draft KV for every layer (a `SeqCache` for fast-mode forwards)."""

    def __init__(
        self, compressed: CompressedKV, tail_capacity: int, kv_heads: int, head_dim: int
    ) -> None:
        self.prefix_length = compressed.prefix_length
        self.layers = [
            DraftLayer(layer, tail_capacity, kv_heads, head_dim) for layer in compressed.layers
        ]

    @property
    def tail_length(self) -> int:
        return self.layers[0].tail_length

    @property
    def next_position(self) -> int:
        return self.prefix_length + self.tail_length

    @property
    def dense(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def layer(self, index: int) -> DraftLayer:
        return self.layers[index]

    def release(self, index: int) -> None:
        """Draft layers stay resident."""

    def truncate(self, tail_length: int) -> None:
        """Roll back to the first `tail_length` tail tokens."""
        for layer in self.layers:
            layer.truncate(tail_length)

    def copy_tail(self, tail: KVCache, start: int, end: int) -> None:
        """Append rows [start, end) of the exact tail (verified KV) to every layer."""
        for mine, exact in zip(self.layers, tail.layers, strict=True):
            mine.append(exact.k[:, start:end], exact.v[:, start:end], exact.positions[start:end])
