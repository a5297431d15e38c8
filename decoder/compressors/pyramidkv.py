"""PyramidKV (Cai et al., 2024): SnapKV selection with budgets shrinking up the layers.

Layer budgets form an arithmetic sequence from the bottom layer to the top one whose
mean is the requested budget; the top layer keeps `1/beta` of the budget beyond the
observation window (PyramidKV's reference schedule).
"""

from __future__ import annotations

from decoder.compressors.base import Budget, LayerContext, Param
from decoder.compressors.snapkv import SnapKV


class PyramidKV(SnapKV):
    name = "pyramidkv"
    params = {
        "budget": Param("budget", Budget(fraction=0.125), "mean tokens kept per layer"),
        "window": Param("int", 32, "observation window: trailing prompt tokens, always kept"),
        "kernel": Param("int", 7, "width of the score pooling (odd)"),
        "beta": Param("int", 20, "bottom-to-top budget ratio parameter (>= 1)"),
    }

    def layer_budget(self, ctx: LayerContext) -> int:
        total = self.budget.resolve(ctx.prefix_length)
        extra = max(0, total - self.window)
        if ctx.num_layers == 1 or extra == 0:
            return total
        low = extra // self.beta
        high = 2 * extra - low
        step = (high - low) / (ctx.num_layers - 1)
        return self.window + round(high - ctx.index * step)
