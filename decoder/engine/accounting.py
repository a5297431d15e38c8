"""Budget bytes of the engine's buffers: the one copy of the per-token byte arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

from decoder.config import ModelConfig, ceil_to

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
