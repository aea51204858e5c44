"""PyramidKV (Cai et al., 2024, arXiv 2406.02069): SnapKV scores with budgets that shrink with depth.

Per-layer budgets follow kvpress / KVCache-Factory: ``max_cap = window + S(1-r)``, ``min_num = (max_cap - window) /
beta``, ``max_num = 2(max_cap - window) - min_num`` (capped at ``S - window``), linear from layer 0 (largest) to the
last compressed layer. Departure: the budgets are rounded so that their sum is exactly ``num_layers * num_kept`` (the
same total as SnapKV; kvpress rounds each layer and the total drifts). Like kvpress, when ``not (S >= max_num >=
min_num >= window)`` (short prompts, strong compression) every layer gets the uniform SnapKV budget.
Layers then hold different lengths; kvforge's attention builds masks per layer, so nothing breaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvforge.presses.layer import LayerContext, Selection, num_kept, topk_mask
from kvforge.presses.snapkv import SnapKVPress


def pyramid_budgets(size: int, compression_ratio: float, num_layers: int, window_size: int, beta: float) -> list[int]:
    """Per-layer kept counts (layer 0 first) summing exactly to ``num_layers * num_kept(size, ratio)``."""
    n = num_kept(size, compression_ratio)
    if num_layers == 1:
        return [n]
    max_cap = window_size + size * (1 - compression_ratio)
    min_num = (max_cap - window_size) / beta
    max_num = 2 * (max_cap - window_size) - min_num
    if max_num >= size - window_size:
        max_num = size - window_size
        min_num = 2 * (max_cap - window_size) - max_num
    if not (size >= max_num >= min_num >= window_size):
        return [n] * num_layers
    raw = [max_num - i * (max_num - min_num) / (num_layers - 1) for i in range(num_layers)]
    shift = sum(raw) / num_layers - n  # float drift between S(1-r) and its floor
    raw = [min(float(size), max(1.0, x - shift)) for x in raw]
    budgets = [math.floor(x) for x in raw]
    missing = num_layers * n - sum(budgets)
    order = sorted(range(num_layers), key=lambda i: raw[i] - budgets[i], reverse=missing > 0)
    for i in order:  # largest remainders first; clamp keeps every budget in [1, size]
        if missing == 0:
            break
        step = 1 if missing > 0 else -1
        if 1 <= budgets[i] + step <= size:
            budgets[i] += step
            missing -= step
    return budgets


@dataclass
class PyramidKVPress(SnapKVPress):
    """SnapKV selection with a pyramid of per-layer budgets (same total as uniform SnapKV)."""

    beta: float = 20.0

    def compress(self, ctx: LayerContext) -> Selection:
        budgets = pyramid_budgets(ctx.size, self.compression_ratio, ctx.num_layers, self.window_size, self.beta)
        n = budgets[ctx.layer_idx]
        if n >= ctx.size:
            return Selection.everything(ctx)
        return Selection(keep=topk_mask(self.score(ctx), n))
