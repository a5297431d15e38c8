"""What one sequence brings to a forward call: new tokens at their positions over its own
cache, and which of them need logits (or observed queries)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from decoder.kv_cache import SeqCache

Logits = Literal["all", "last", "none"]


@dataclass
class SeqInput:
    """New tokens of one sequence for a forward call."""

    tokens: torch.Tensor  # [t] int64
    positions: torch.Tensor  # [t] int64 absolute positions, increasing, after the cache's
    cache: SeqCache
    logits: Logits = "last"
    """Which of the new tokens need logits."""
    observe: int = 0
    """Capture the rotated (unscaled) queries of this many trailing new tokens at every layer
    into `observed` (what compressors such as SnapKV score the prefix with)."""
    observed: list[torch.Tensor] = field(default_factory=list)
    """Filled by `forward` when `observe > 0`: one [observe, H, D] tensor per layer."""

    @classmethod
    def extend(
        cls,
        cache: SeqCache,
        tokens: Sequence[int] | torch.Tensor,
        logits: Logits = "last",
        observe: int = 0,
    ) -> SeqInput:
        """Tokens that continue `cache` at the next consecutive positions."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        start = cache.next_position
        return cls(ids, torch.arange(start, start + ids.numel()), cache, logits, observe)
