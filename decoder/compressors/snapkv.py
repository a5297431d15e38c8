"""SnapKV (Li et al., 2024): keep the tokens the prompt's last window attends to most.

Scores are the observation window's attention (summed over its queries, averaged over
the query heads sharing a kv head), smoothed by average pooling; each kv head keeps its
own top tokens plus the window itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from decoder.compressors.base import (
    Budget,
    CompressedLayer,
    Compressor,
    LayerContext,
    Param,
    gather_tokens,
    observed_scores,
)


class SnapKV(Compressor):
    name = "snapkv"
    drops_tokens = True
    params = {
        "budget": Param("budget", Budget(fraction=0.125), "tokens kept (fraction or count)"),
        "window": Param("int", 32, "observation window: trailing prompt tokens, always kept"),
        "kernel": Param("int", 7, "width of the score pooling (odd)"),
    }

    @property
    def observe_window(self) -> int:
        return self.window

    def layer_budget(self, ctx: LayerContext) -> int:
        return self.budget.resolve(ctx.prefix_length)

    def compress_layer(
        self, layer: CompressedLayer, queries: torch.Tensor | None, ctx: LayerContext
    ) -> CompressedLayer:
        assert queries is not None
        return select_observed(
            layer, queries, self.layer_budget(ctx), self.window, self.kernel, ctx.prefix_length
        )


def select_observed(
    layer: CompressedLayer,
    queries: torch.Tensor,
    keep: int,
    window: int,
    kernel: int,
    prefix_length: int,
) -> CompressedLayer:
    """SnapKV's selection: the last `window` tokens plus the top pooled-score others."""
    n = layer.kept
    if keep >= n:
        return layer
    window = min(window, n, keep)
    heads = layer.positions.shape[0]
    if keep == window:
        return gather_tokens(layer, torch.arange(n - window, n).expand(heads, -1))
    scores = observed_scores(layer, queries, min(window, queries.shape[0]), prefix_length)
    candidates = scores[:, : n - window]
    if kernel > 1:
        candidates = F.avg_pool1d(
            candidates.unsqueeze(1), kernel, stride=1, padding=kernel // 2, count_include_pad=False
        ).squeeze(1)
    top = torch.topk(candidates, keep - window, dim=-1).indices.sort(dim=-1).values
    recent = torch.arange(n - window, n).expand(heads, -1)
    return gather_tokens(layer, torch.cat([top, recent], dim=-1))
