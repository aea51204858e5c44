"""CriticalKV (arXiv 2502.03805, "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective").

Per head, the first ``first_stage_ratio`` (alpha = 0.5) of the budget goes to the highest attention scores, the rest
to the highest ``(A_i + eps) * ||(V W_O)_i||_1``, where ``W_O`` is the head's slice of the output projection (the
norm is averaged over the query heads of a GQA group, as in kvpress). A drop-in selection for SnapKV
(:class:`CriticalKVPress`) and AdaKV (:class:`CriticalAdaKVPress`); scores come from the wrapped scorer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvforge.presses.adakv import adaptive_budgets
from kvforge.presses.base import LayerContext, Selection, WrapperPress, num_kept, topk_mask_varying

_ROWS = 1024  # value rows projected at once: bounds the (H, rows, hidden) temporary


def projected_value_norms(ctx: LayerContext) -> Tensor:
    """``(B, H_kv, S)``: ``||V_i W_O^h||_1`` per query head h, averaged over each GQA group."""
    if ctx.output_weight is None:
        raise ValueError("CriticalKV needs the layer's output projection (ctx.output_weight)")
    b, h_kv, s, d = ctx.values.shape
    g = ctx.group_size
    hidden = ctx.output_weight.shape[0]
    # W_O (hidden, H*D) -> per KV head (D, g*hidden): one GEMM per KV head, no copy of the values
    w = ctx.output_weight.t().reshape(h_kv, g, d, hidden).permute(0, 2, 1, 3).reshape(h_kv, d, g * hidden)
    w = w.to(ctx.values.dtype)
    norms = [
        (ctx.values[:, :, i : i + _ROWS] @ w).abs_().view(b, h_kv, -1, g, hidden).sum(-1).float().mean(-1)
        for i in range(0, s, _ROWS)
    ]
    return torch.cat(norms, dim=2)  # (B, H_kv, S)


def critical_select(scores: Tensor, norms: Tensor, budgets: Tensor, first_stage_ratio: float, eps: float) -> Tensor:
    """Two-stage selection per head with per-head ``budgets`` ``(B, H_kv)``; returns the keep mask."""
    scores = scores.float()
    stage1 = topk_mask_varying(scores, (budgets.float() * first_stage_ratio).long())
    critical = (scores + eps) * norms
    critical = critical.masked_fill(stage1, float("inf"))
    return topk_mask_varying(critical, budgets)


@dataclass
class CriticalKVPress(WrapperPress):
    """Uniform per-head budget, two-stage (attention, then attention x projected value norm) selection."""

    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.first_stage_ratio <= 1.0:
            raise ValueError(f"first_stage_ratio must be in [0, 1], got {self.first_stage_ratio}")

    def compress(self, ctx: LayerContext) -> Selection:
        n = num_kept(ctx.size, self.compression_ratio)
        if n >= ctx.size:
            return Selection(keep=torch.ones(ctx.keys.shape[:3], dtype=torch.bool, device=ctx.keys.device))
        scores = self.press.score(ctx)
        budgets = torch.full(scores.shape[:2], n, dtype=torch.long, device=scores.device)
        keep = critical_select(scores, projected_value_norms(ctx), budgets, self.first_stage_ratio, self.epsilon)
        return Selection(keep=keep)


@dataclass
class CriticalAdaKVPress(CriticalKVPress):
    """AdaKV per-head budgets (exact layer total), then CriticalKV's two-stage selection inside each head."""

    alpha_safeguard: float = 0.2

    def compress(self, ctx: LayerContext) -> Selection:
        n = num_kept(ctx.size, self.compression_ratio)
        if n >= ctx.size:
            return Selection(keep=torch.ones(ctx.keys.shape[:3], dtype=torch.bool, device=ctx.keys.device))
        scores = self.press.score(ctx)
        _, budgets = adaptive_budgets(scores, n, self.alpha_safeguard)
        keep = critical_select(scores, projected_value_norms(ctx), budgets, self.first_stage_ratio, self.epsilon)
        return Selection(keep=keep)
