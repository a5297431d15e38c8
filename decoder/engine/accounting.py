"""Budget bytes of the engine's buffers: the one copy of the per-token byte arithmetic."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decoder.config import ModelConfig, ceil_to

if TYPE_CHECKING:
    from decoder.compressors import CompressedKV
    from decoder.engine.config import EngineConfig
    from decoder.engine.request import Prefix, Request
    from decoder.engine.state import PrefixGroup
    from decoder.staging import LayerRing

POSITION_BYTES = 8  # int64 position per token and layer (and per kv head in draft buffers)


@dataclass(frozen=True, slots=True)
class KVBytes:
    """Bytes of the buffers the engine allocates for a model with fp32 KV.

    Dense caches (`KVCache`, staging, resident prefixes) grow in granules of the runner's
    key chunk and keep one position per token and layer; draft buffers keep one position per
    token, layer and kv head.
    """

    model: ModelConfig
    granule: int

    @property
    def token(self) -> int:
        """Full KV of one token over all layers (what a pull moves)."""
        return self.model.kv_bytes_per_token

    def dense(self, tokens: int) -> int:
        """A dense cache with room for `tokens` tokens."""
        per_token = self.token + POSITION_BYTES * self.model.num_layers
        return ceil_to(tokens, self.granule) * per_token

    @property
    def draft_layer_token(self) -> int:
        """One token in one layer of a draft buffer (keys, values, per-head positions)."""
        m = self.model
        return m.num_kv_heads * (2 * m.head_dim * 4 + POSITION_BYTES)

    def draft_tail(self, tokens: int) -> int:
        """A request's own draft tail of `tokens` tokens over all layers."""
        return tokens * self.model.num_layers * self.draft_layer_token


class Footprint:
    """What admitting a request adds to the budget: its own buffers, and how much the
    buffers its prefix group and the engine share must grow for it."""

    def __init__(
        self,
        kv_bytes: KVBytes,
        config: EngineConfig,
        compressed: Callable[[Prefix], CompressedKV] | None,
        ring: LayerRing,
    ) -> None:
        """compressed: the prefix's compressed KV (None in full mode: nothing is drafted)."""
        self.bytes = kv_bytes
        self.config = config
        self.compressed = compressed
        self.ring = ring

    def tail_capacity(self, req: Request) -> int:
        return len(req.suffix) + req.max_new_tokens + self.config.max_horizon + 1

    def own(self, tail_capacity: int, drafts: bool = True) -> int:
        """A request's own buffers: its exact tail and, when it drafts (`drafts`, and not
        in full mode), its draft tail."""
        tail = self.bytes.dense(tail_capacity)
        if self.compressed is None or not drafts:
            return tail
        return tail + self.bytes.draft_tail(tail_capacity)

    def buffers_growth(self, group: PrefixGroup, room: int, kv: CompressedKV | None = None) -> int:
        """Budget bytes the group's shared buffers grow by to hold `room` tail tokens (`kv`:
        its compressed prefix, when not the one kept with the prefix)."""
        if self.compressed is None:
            return self.bytes.dense(group.source.length + room) - group.buffers
        per_token = self.bytes.draft_layer_token
        total = 0
        for layer in (kv or self.compressed(group.prefix)).layers:
            total += layer.nbytes if layer.quantized else (layer.kept + room) * per_token
        return total - group.buffers

    def scratch_growth(
        self, group: PrefixGroup, room: int, charged: int, kv: CompressedKV | None = None
    ) -> int:
        """Budget bytes the shared decode buffer of quantized prefixes grows by (`charged`:
        what it holds now; `kv` as in `buffers_growth`)."""
        if self.compressed is None:
            return 0
        layers = (kv or self.compressed(group.prefix)).layers
        if not any(layer.quantized for layer in layers):
            return 0
        widest = max(layer.kept for layer in layers) + room
        return max(0, widest * self.bytes.draft_layer_token - charged)

    def staging_growth(self, capacity: int, charged: int) -> int:
        """Budget bytes the staging ring grows by to stage `capacity` tokens (`charged`:
        what it holds now)."""
        if self.compressed is None:
            return 0
        return max(0, self.ring.bytes_for(capacity) - charged)
