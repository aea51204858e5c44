"""AdaKV (Feng et al., 2024, arXiv 2407.11550): spend a layer's budget across its KV heads with one top-k.

Every head first keeps its top ``alpha_safeguard`` share of the uniform budget (kvpress's safeguard), then the
remaining layer budget goes to the highest scores over all heads at once, so heads keep different numbers of
entries and the layer total is exactly ``H_kv * num_kept``. Departure from kvpress (which only masks evicted entries
and saves no memory): the selection is installed per head (packed to the longest head, padding masked), so memory
really shrinks to the longest head's length.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvforge.presses.base import WrapperPress
from kvforge.presses.layer import LayerContext, Selection, num_kept, topk_mask


def adaptive_budgets(scores: Tensor, n: int, alpha_safeguard: float) -> tuple[Tensor, Tensor]:
    """AdaKV selection on ``(B, H_kv, S)`` scores: ``(keep mask, per-head counts (B, H_kv))``, total ``H_kv * n``."""
    b, h, s = scores.shape
    scores = scores.float().nan_to_num(float("-inf"))
    safe = topk_mask(scores, int(n * alpha_safeguard))  # each head's guaranteed share
    forced = scores.masked_fill(safe, float("inf")).reshape(b, h * s)
    keep = topk_mask(forced, h * n).reshape(b, h, s)
    return keep, keep.sum(dim=-1)


@dataclass
class AdaKVPress(WrapperPress):
    """Head-adaptive budgets over an inner scorer (default SnapKV); exact per-layer total."""

    alpha_safeguard: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha_safeguard <= 1.0:
            raise ValueError(f"alpha_safeguard must be in [0, 1], got {self.alpha_safeguard}")

    def compress(self, ctx: LayerContext) -> Selection:
        n = num_kept(ctx.size, self.compression_ratio)
        if n >= ctx.size:
            return Selection.everything(ctx)
        keep, _ = adaptive_budgets(self.press.score(ctx), n, self.alpha_safeguard)
        return Selection(keep=keep)
