"""SnapKV (Li et al., 2024, arXiv 2404.14469): keep what the observation window attends to.

Score = softmax attention of the last ``window_size`` prompt queries to every entry, averaged over those queries,
average-pooled over the token axis (``kernel_size``), averaged over the query heads of a GQA group; the window's own
entries are always kept. The window queries are recomputed from the window's hidden states (q_proj, q_norm, RoPE):
the S x S attention is never built.

``lookahead`` (kvforge addition): decode that many greedy draft tokens with the full cache first and add the mean
attention of their queries to the window's (then drop the drafts). On small models the question's queries do not
single out the needle, the answer's first tokens do (see docs/presses.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvforge.presses.base import WindowPress
from kvforge.presses.layer import LayerContext, pool_tokens


@dataclass
class SnapKVPress(WindowPress):
    """SnapKV scores (window attention, pooled, GQA-averaged); per-head top-k with the window always kept."""

    kernel_size: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {self.kernel_size}")

    def attention_scores(self, ctx: LayerContext) -> Tensor:
        """``(B, H_kv, S)`` pooled, group-averaged window (+ lookahead) attention, before the window is forced in."""
        window = ctx.window_mask(self.window_size)[:, None, :]  # (B, 1, S)
        scores = ctx.observed_attention(self.window_size).masked_fill(window, 0.0)  # window: zero padding (kvpress)
        # mean over the GQA group (the issue says "summed": same ranking; the mean keeps kvpress's scale, which
        # matters where an epsilon is added to the scores, as in CriticalKV's stage 2)
        return ctx.group_reduce(pool_tokens(scores, self.kernel_size), "mean")  # (B, H_kv, S)

    def score(self, ctx: LayerContext) -> Tensor:
        scores = self.attention_scores(ctx)
        window = ctx.window_mask(self.window_size)[:, None, :]  # (B, 1, S)
        return scores.masked_fill(window, float("inf"))
