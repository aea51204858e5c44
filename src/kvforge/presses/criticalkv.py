"""CriticalKV (arXiv 2502.03805, "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective").

Per head, the first ``first_stage_ratio`` (alpha = 0.5) of the budget goes to the highest attention scores, the rest
to the highest ``(A_i + eps) * ||(V W_O)_i||_1``, where ``W_O`` is the head's slice of the output projection (the
norm is averaged over the query heads of a GQA group, as in kvpress). A drop-in selection for SnapKV
(:class:`CriticalKVPress`) and AdaKV (:class:`CriticalAdaKVPress`); scores come from the wrapped scorer.

The L1 norm of a projection does not factor through anything per head, so the exact norm costs a
``(tokens, D) x (D, g * hidden)`` product. What is computed once per layer and head is ``W_O``'s Gram matrix
``G = W_O W_O^T`` (``D x D``): with it, ``||V_i W_O||_2 = sqrt(V_i G V_i^T)`` costs ``D^2`` per token, and
``||x||_2 <= ||x||_1 <= sqrt(hidden) ||x||_2`` bounds every token's second-stage score. The exact norm is then
computed only for the tokens whose upper bound can still reach the budget (:func:`critical_select_pruned`); the
selection is the same as computing every norm (up to exact ties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvforge.presses.adakv import adaptive_budgets
from kvforge.presses.base import WrapperPress
from kvforge.presses.layer import LayerContext, Selection, num_kept, topk_mask_varying

_ROWS = 1024  # value rows projected at once: bounds the (H, rows, hidden) temporary


def _grouped_output_weight(ctx: LayerContext) -> Tensor:
    """``W_O`` ``(hidden, H * D)`` regrouped per KV head: ``(H_kv, D, g * hidden)`` (one GEMM per KV head)."""
    if ctx.output_weight is None:
        raise ValueError("CriticalKV needs the layer's output projection (ctx.output_weight)")
    _, h_kv, _, d = ctx.values.shape
    hidden = ctx.output_weight.shape[0]
    w = ctx.output_weight.t().reshape(h_kv, ctx.group_size, d, hidden).permute(0, 2, 1, 3)
    return w.reshape(h_kv, d, ctx.group_size * hidden).to(ctx.values.dtype)


def _l1_norms(values: Tensor, w: Tensor, group: int) -> Tensor:
    """``(B, H_kv, N)``: ``mean_g ||v W_O^g||_1`` for ``values`` ``(B, H_kv, N, D)`` and ``w`` from above."""
    b, h_kv = values.shape[:2]
    hidden = w.shape[-1] // group
    norms = [
        (values[:, :, i : i + _ROWS] @ w).abs_().view(b, h_kv, -1, group, hidden).sum(-1).float().mean(-1)
        for i in range(0, values.shape[2], _ROWS)
    ]
    return torch.cat(norms, dim=2)


def projected_value_norms(ctx: LayerContext) -> Tensor:
    """``(B, H_kv, S)``: ``||V_i W_O^h||_1`` per query head h, averaged over each GQA group (every token)."""
    return _l1_norms(ctx.values, _grouped_output_weight(ctx), ctx.group_size)


def value_norm_bounds(ctx: LayerContext, w: Tensor) -> tuple[Tensor, Tensor]:
    """``(lower, upper)`` ``(B, H_kv, S)`` on :func:`projected_value_norms`, from per-head ``D x D`` quantities.

    Per query head ``g`` with ``W_g`` ``(D, hidden)`` and an orthonormal basis ``u_i`` of ``D`` (``W_g W_g^T``'s
    eigenvectors), both computed once per layer and head: ``||v W_g||_2 <= ||v W_g||_1`` and
    ``||v W_g||_1 <= min(sqrt(hidden) ||v W_g||_2, sum_i |<v, u_i>| ||u_i W_g||_1)``; averaged over the group.
    They cost ``D^2`` per token instead of the exact norm's ``D * hidden``.
    """
    g = ctx.group_size
    h_kv, d, gh = w.shape
    wg = w.float().view(h_kv, d, g, gh // g).permute(0, 2, 1, 3)  # (H_kv, g, D, hidden)
    eigvals, basis = torch.linalg.eigh(wg @ wg.transpose(-1, -2))  # W W^T = U diag U^T, once per layer and head
    row_l1 = (basis.transpose(-1, -2) @ wg).abs().sum(-1)  # (H_kv, g, D): ||u_i W_g||_1
    coeff = torch.einsum("bksd,kgdi->bkgsi", ctx.values.float(), basis)  # (B, H_kv, g, S, D): <v, u_i>
    l2 = (coeff.square() * eigvals.clamp_min(0)[None, :, :, None, :]).sum(-1).sqrt()  # ||v W_g||_2
    by_basis = (coeff.abs() * row_l1[None, :, :, None, :]).sum(-1)
    upper = torch.minimum(l2 * (gh // g) ** 0.5, by_basis)
    slack = 1.0 + 1e-3  # float rounding must never make a bound exclude a token it should not
    return l2.mean(2) / slack, upper.mean(2) * slack


def _exact_norms_where(mask: Tensor, values: Tensor, w: Tensor, group: int, norms: Tensor) -> None:
    """Write the exact :func:`_l1_norms` of the tokens where ``mask`` ``(B, H_kv, S)`` is True into ``norms``."""
    for bi in range(mask.shape[0]):
        for k in range(mask.shape[1]):
            idx = mask[bi, k].nonzero()[:, 0]
            if idx.numel():
                norms[bi, k, idx] = _l1_norms(values[bi, k, idx][None, None], w[k : k + 1], group)[0, 0]


def critical_select_pruned(
    scores: Tensor, ctx: LayerContext, budgets: Tensor, first_stage_ratio: float, eps: float
) -> Tensor:
    """:func:`critical_select` with the exact value norms of only the tokens that can still be chosen.

    Stage 1 keeps the top ``budget * first_stage_ratio`` scores (no norm needed). For the remaining ``k2`` slots of a
    head: exact norms for the ``k2`` tokens with the highest upper bound give a threshold ``T`` (the k2-th of their
    exact second-stage scores); a token whose upper bound is below ``T`` cannot be among the top ``k2`` and gets no
    norm; every other token gets its exact one. The keep mask equals :func:`critical_select`'s with every norm.
    """
    scores = scores.float()
    stage1 = topk_mask_varying(scores, (budgets.float() * first_stage_ratio).long())
    k2 = (budgets - stage1.sum(-1)).clamp_min(0)  # (B, H_kv) second-stage slots
    norms = torch.zeros_like(scores)
    if int(k2.max() if k2.numel() else 0) > 0:
        w = _grouped_output_weight(ctx)
        _, upper = value_norm_bounds(ctx, w)
        bound = ((scores + eps) * upper).masked_fill_(stage1, float("-inf"))  # (B, H_kv, S)
        first = topk_mask_varying(bound, k2) & ~stage1  # per head: the k2 highest upper bounds
        _exact_norms_where(first, ctx.values, w, ctx.group_size, norms)
        critical = ((scores + eps) * norms).masked_fill_(~first, float("-inf"))
        kth = critical.sort(dim=-1, descending=True).values.gather(-1, (k2 - 1).clamp_min(0)[..., None])
        threshold = kth.masked_fill_(k2[..., None] == 0, float("inf"))  # (B, H_kv, 1)
        _exact_norms_where((bound >= threshold) & ~first & ~stage1, ctx.values, w, ctx.group_size, norms)
    critical = ((scores + eps) * norms).masked_fill_(stage1, float("inf"))
    return topk_mask_varying(critical, budgets)


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
            return Selection.everything(ctx)
        scores = self.press.score(ctx)
        budgets = torch.full(scores.shape[:2], n, dtype=torch.long, device=scores.device)
        keep = critical_select_pruned(scores, ctx, budgets, self.first_stage_ratio, self.epsilon)
        return Selection(keep=keep)


@dataclass
class CriticalAdaKVPress(CriticalKVPress):
    """AdaKV per-head budgets (exact layer total), then CriticalKV's two-stage selection inside each head."""

    alpha_safeguard: float = 0.2

    def compress(self, ctx: LayerContext) -> Selection:
        n = num_kept(ctx.size, self.compression_ratio)
        if n >= ctx.size:
            return Selection.everything(ctx)
        scores = self.press.score(ctx)
        _, budgets = adaptive_budgets(scores, n, self.alpha_safeguard)
        keep = critical_select_pruned(scores, ctx, budgets, self.first_stage_ratio, self.epsilon)
        return Selection(keep=keep)
