"""StreamingLLM (Xiao et al., 2023): keep the first `sink` tokens and a recent window."""

from __future__ import annotations

import torch

from decoder.compressors.base import (
    Budget,
    CompressedLayer,
    Compressor,
    LayerContext,
    Param,
    gather_tokens,
)


class StreamingLLM(Compressor):
    name = "streamingllm"
    drops_tokens = True
    params = {
        "sink": Param("int", 4, "attention-sink tokens kept at the start"),
        "window": Param("int", 0, "recent tokens kept (0: the budget minus the sinks)"),
        "budget": Param(
            "budget",
            Budget(fraction=0.125),
            "tokens kept in all when window is 0 (fraction or count)",
        ),
    }

    def compress_layer(
        self, layer: CompressedLayer, queries: torch.Tensor | None, ctx: LayerContext
    ) -> CompressedLayer:
        n = layer.kept
        window = self.window or max(0, self.budget.resolve(ctx.prefix_length) - self.sink)
        if self.sink + window >= n:
            return layer
        keep = torch.cat([torch.arange(self.sink), torch.arange(n - window, n)])
        return gather_tokens(layer, keep.expand(layer.positions.shape[0], -1))
