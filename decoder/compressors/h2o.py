"""H2O (Zhang et al., 2023): keep heavy hitters plus the most recent tokens.

Heavy hitters are the tokens with the largest accumulated attention from the observed
queries at the end of the prefix (one-shot, at compression time); a share of the budget
goes to the most recent tokens.
"""

from __future__ import annotations

import torch

from decoder.compressors.base import (
    Budget,
    CompressedLayer,
    Compressor,
    LayerContext,
    Param,
    gather_tokens,
    observed_scores,
)


class H2O(Compressor):
    name = "h2o"
    drops_tokens = True
    params = {
        "budget": Param("budget", Budget(fraction=0.125), "tokens kept (fraction or count)"),
        "recent": Param("float", 0.5, "share of the budget kept as the most recent tokens"),
        "window": Param("int", 128, "observed queries whose attention is accumulated"),
    }

    @property
    def observe_window(self) -> int:
        return self.window

    def compress_layer(
        self, layer: CompressedLayer, queries: torch.Tensor | None, ctx: LayerContext
    ) -> CompressedLayer:
        assert queries is not None
        n, keep = layer.kept, self.budget.resolve(ctx.prefix_length)
        if keep >= n:
            return layer
        recent = min(keep, max(1, round(self.recent * keep)))
        heads = layer.positions.shape[0]
        recent_idx = torch.arange(n - recent, n).expand(heads, -1)
        if keep == recent:
            return gather_tokens(layer, recent_idx)
        window = min(self.window, queries.shape[0])
        scores = observed_scores(layer, queries, window, ctx.prefix_length)[:, : n - recent]
        heavy = torch.topk(scores, keep - recent, dim=-1).indices.sort(dim=-1).values
        return gather_tokens(layer, torch.cat([heavy, recent_idx], dim=-1))
