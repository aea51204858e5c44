"""H2O (Zhang et al., 2023, arXiv 2306.14048): heavy hitters by accumulated attention + the most recent tokens.

Departure: H2O evicts step by step while generating, accumulating the attention every query gave. Here the prompt
is compressed once after prefill, and the accumulated attention is that of the last ``window_size`` prompt queries
(summed, not averaged, and without pooling), so the S x S attention of the prompt is never built. Half of the
budget (``recent_ratio``) goes to the newest tokens, the rest to the heavy hitters, as in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvforge.presses.base import WindowPress
from kvforge.presses.layer import LayerContext, num_kept


@dataclass
class H2OPress(WindowPress):
    """Keep ``recent_ratio`` of the budget as the newest entries, the rest by accumulated window attention."""

    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")

    def score(self, ctx: LayerContext) -> Tensor:
        attn = ctx.observed_attention(self.window_size) * min(self.window_size, ctx.size)  # mean -> accumulated
        scores = ctx.group_reduce(attn, "sum")  # (B, H_kv, S)
        num_recent = int(num_kept(ctx.size, self.compression_ratio) * self.recent_ratio)
        if num_recent > 0:
            recent = torch.zeros(ctx.size, dtype=torch.bool, device=scores.device)
            recent[-num_recent:] = True
            scores = scores.masked_fill(recent, float("inf"))
        return scores
