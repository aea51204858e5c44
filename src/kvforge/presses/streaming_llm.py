"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): attention sinks + the most recent tokens.

Departure: applied once to the prompt (one-shot eviction at prefill), not as a rolling window during decoding;
for an endless rolling window use ``KVCache(window=..., num_sink=...)`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvforge.presses.base import ScorerPress
from kvforge.presses.layer import LayerContext


@dataclass
class StreamingLLMPress(ScorerPress):
    """Keep entries at positions ``< num_sink`` (the sinks) and fill the rest of the budget with the newest ones."""

    num_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_sink < 0:
            raise ValueError(f"num_sink must be >= 0, got {self.num_sink}")

    def score(self, ctx: LayerContext) -> Tensor:
        pos = ctx.positions.to(torch.float64)  # (B, S): newer = higher
        scores = torch.where(ctx.positions < self.num_sink, torch.full_like(pos, float("inf")), pos)
        return scores[:, None, :].expand(-1, ctx.keys.shape[1], -1)  # (B, H_kv, S)
