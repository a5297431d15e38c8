"""The compressor interface (DESIGN.md section 6) and the compressed KV it produces.

A compressor turns one layer of a prefix's KV into a smaller layer the drafter attends
over. It sees the layer's keys and values with their absolute positions and the queries
the prefill observed at the end of the prefix (rotated, unscaled). Token droppers keep a
subset of positions per kv head, with their original RoPE positions; quantizers store
packed integers and scales. Stages compose left to right (drop, then quantize).

Byte sizes are the real sizes of the tensors kept in memory, positions included.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


class CompressedLayer(ABC):
    """One layer of compressed prefix KV: `n` kept tokens per kv head."""

    positions: torch.Tensor
    """[KVH, n] int32 absolute positions of the kept tokens, increasing per head."""

    @property
    def kept(self) -> int:
        return self.positions.shape[1]

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this layer occupies in memory."""

    @property
    @abstractmethod
    def quantized(self) -> bool:
        """True when `materialize` must decode (the drafter then decodes it every step)."""

    @abstractmethod
    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as float32 [KVH, n, D] each."""


class DenseLayer(CompressedLayer):
    """Kept tokens stored in full precision."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        self.k, self.v = k, v
        self.positions = positions.to(torch.int32)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.k, self.v, self.positions)

    @property
    def quantized(self) -> bool:
        return False

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


@dataclass
class CompressedKV:
    """The compressed KV of a whole prefix for one compressor spec."""

    spec: str
    prefix_length: int
    layers: list[CompressedLayer]
    full_nbytes: int
    """Bytes of the uncompressed prefix KV it stands for."""

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def ratio(self) -> float:
        """Full bytes over compressed bytes."""
        return self.full_nbytes / max(1, self.nbytes)


@dataclass(frozen=True, slots=True)
class LayerContext:
    """Where a layer sits, for compressors whose budget varies by layer."""

    index: int
    num_layers: int
    prefix_length: int


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a compressor spec."""

    kind: str  # "int", "float", "budget" or "choice:<a>|<b>"
    default: Any
    help: str


class Compressor(ABC):
    """One stage of a compressor spec, configured from `name:key=value,...`."""

    name: ClassVar[str]
    drops_tokens: ClassVar[bool]
    params: ClassVar[dict[str, Param]]

    def __init__(self, **values: Any) -> None:
        self.values = values

    def __getattr__(self, item: str) -> Any:
        values = self.__dict__.get("values", {})
        if item in values:
            return values[item]
        raise AttributeError(item)

    @property
    def spec(self) -> str:
        """Canonical spec string: every parameter, in declaration order."""
        args = ",".join(f"{k}={_format(self.values[k])}" for k in self.params)
        return f"{self.name}:{args}" if args else self.name

    @property
    def observe_window(self) -> int:
        """How many trailing prefix queries per layer this stage scores with (0: none)."""
        return 0

    @abstractmethod
    def compress_layer(
        self, layer: CompressedLayer, queries: torch.Tensor | None, ctx: LayerContext
    ) -> CompressedLayer:
        """queries: [w, H, D] of the last w prefix tokens (w >= observe_window), or None."""


@dataclass(frozen=True, slots=True)
class Budget:
    """Tokens to keep: a fraction of the prefix (0 < f < 1) or an absolute count."""

    fraction: float | None = None
    tokens: int | None = None

    def resolve(self, prefix_length: int) -> int:
        if self.tokens is not None:
            return min(prefix_length, self.tokens)
        assert self.fraction is not None
        return min(prefix_length, max(1, round(self.fraction * prefix_length)))

    def __str__(self) -> str:
        return str(self.tokens) if self.tokens is not None else repr(self.fraction)


def _format(value: Any) -> str:
    return (
        str(value)
        if isinstance(value, Budget)
        else repr(value)
        if isinstance(value, float)
        else str(value)
    )


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def gather_tokens(layer: CompressedLayer, index: torch.Tensor) -> DenseLayer:
    """Keep the slots `index` ([KVH, m], increasing per head) of an unquantized layer."""
    k, v = layer.materialize()
    expand = index.unsqueeze(-1).expand(-1, -1, k.shape[-1])
    return DenseLayer(
        k.gather(1, expand).contiguous(),
        v.gather(1, expand).contiguous(),
        layer.positions.gather(1, index),
    )


def observed_scores(
    layer: CompressedLayer, queries: torch.Tensor, window: int, prefix_length: int
) -> torch.Tensor:
    """Attention each kept key receives from the last `window` observed queries.

    Softmax over the layer's keys, causal by position, summed over the window queries and
    averaged over the query heads of each kv head. Returns [KVH, n] float32.
    """
    k, _ = layer.materialize()
    kv_heads, n, dim = k.shape
    q = queries[-window:]  # [w, H, D]
    w, heads, _ = q.shape
    group = heads // kv_heads
    q_pos = torch.arange(prefix_length - w, prefix_length)  # the window ends the prefix
    q = q.permute(1, 0, 2).reshape(kv_heads, group * w, dim)  # [KVH, group*w, D]
    logits = torch.matmul(q, k.transpose(1, 2)) / dim**0.5  # [KVH, group*w, n]
    future = layer.positions.long()[:, None, :] > q_pos.repeat(group)[None, :, None]
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    return probs.sum(1) / group
