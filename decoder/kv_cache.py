"""Per-sequence KV caches with explicit absolute positions."""

from __future__ import annotations

from typing import Protocol

import torch

from decoder.config import ModelConfig, ceil_to


class LayerKV:
    """Keys and values of one layer of one sequence.

    Storage is [KVH, capacity, D] with live slots [0, length); `positions[i]` is the absolute
    position of slot i, strictly increasing. Capacity grows in multiples of `granule`, and
    slots at or past `length` always hold finite values (zeros, or stale rows after a
    truncation), which exact attention relies on when it masks them.
    """

    def __init__(self, kv_heads: int, head_dim: int, granule: int, capacity: int = 0) -> None:
        self.granule = granule
        cap = ceil_to(capacity, granule) if capacity else 0
        self.k = torch.zeros(kv_heads, cap, head_dim)
        self.v = torch.zeros(kv_heads, cap, head_dim)
        self.positions = torch.zeros(cap, dtype=torch.long)
        self.length = 0
        self.dense = True
        """True while slot i holds position i for every live slot (a full cache)."""

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of live keys and values."""
        return 2 * self.length * self.k.shape[0] * self.k.shape[2] * self.k.element_size()

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v: [KVH, t, D]; positions: [t], increasing and after every live position."""
        t = positions.shape[0]
        self._reserve(self.length + t)
        end = self.length + t
        self.k[:, self.length : end] = k
        self.v[:, self.length : end] = v
        self.positions[self.length : end] = positions
        if self.dense and t:
            self.dense = int(positions[0]) == self.length and int(positions[-1]) == end - 1
        self.length = end

    def truncate(self, length: int) -> None:
        """Drop every slot from `length` on (rollback). Dropped slots are zeroed."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length {length} outside [0, {self.length}]")
        self.k[:, length : self.length] = 0
        self.v[:, length : self.length] = 0
        self.length = length
        if length == 0:
            self.dense = True

    def clone(self, extra_capacity: int = 0) -> LayerKV:
        """An independent copy of the live slots, with room for `extra_capacity` more."""
        kv_heads, _, dim = self.k.shape
        copy = LayerKV(kv_heads, dim, self.granule, self.length + extra_capacity)
        copy.k[:, : self.length] = self.k[:, : self.length]
        copy.v[:, : self.length] = self.v[:, : self.length]
        copy.positions[: self.length] = self.positions[: self.length]
        copy.length, copy.dense = self.length, self.dense
        return copy

    def live(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v, positions) of the live slots: [KVH, n, D], [KVH, n, D], [n] (views)."""
        n = self.length
        return self.k[:, :n], self.v[:, :n], self.positions[:n]

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cap = ceil_to(max(needed, 2 * self.capacity), self.granule)
        kv_heads, _, dim = self.k.shape
        for name in ("k", "v"):
            grown = torch.zeros(kv_heads, cap, dim)
            grown[:, : self.length] = getattr(self, name)[:, : self.length]
            setattr(self, name, grown)
        positions = torch.zeros(cap, dtype=torch.long)
        positions[: self.length] = self.positions[: self.length]
        self.positions = positions


class LayerCache(Protocol):
    """What the runner needs of one layer's cache during a forward call."""

    k: torch.Tensor
    v: torch.Tensor

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None: ...

    def live(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys [KVH, n, D], values [KVH, n, D], positions [n] or per head [KVH, n])."""
        ...


class SeqCache(Protocol):
    """A sequence's KV as the runner consumes it: one layer at a time.

    The runner calls `layer(i)` before it attends at layer i and `release(i)` right after,
    in layer order, so an implementation may assemble a layer on demand (for example,
    stream a remote prefix into a staging buffer) and hand its memory back on release.
    """

    @property
    def next_position(self) -> int: ...

    @property
    def dense(self) -> bool: ...

    def layer(self, index: int) -> LayerCache: ...

    def release(self, index: int) -> None: ...


class KVCache:
    """The KV of one sequence for every layer, resident in memory."""

    def __init__(self, config: ModelConfig, granule: int, capacity: int = 0) -> None:
        self.layers = [
            LayerKV(config.num_kv_heads, config.head_dim, granule, capacity)
            for _ in range(config.num_layers)
        ]

    def __len__(self) -> int:
        return self.layers[0].length

    @property
    def next_position(self) -> int:
        """The position right after the last cached token (0 when empty)."""
        layer = self.layers[0]
        return int(layer.positions[layer.length - 1]) + 1 if layer.length else 0

    @property
    def dense(self) -> bool:
        return all(layer.dense for layer in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def layer(self, index: int) -> LayerKV:
        return self.layers[index]

    def release(self, index: int) -> None:
        """Resident layers stay where they are."""

    def clone(self, extra_capacity: int = 0) -> KVCache:
        """An independent copy (for example, one prefix continued by several requests)."""
        copy = KVCache.__new__(KVCache)
        copy.layers = [layer.clone(extra_capacity) for layer in self.layers]
        return copy

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)
