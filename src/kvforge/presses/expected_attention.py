"""Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", arXiv 2510.00463; kvpress's default press).

Future queries are modelled as a Gaussian: mean ``mu`` and covariance ``Sigma`` of the prompt's pre-RoPE queries
(positions >= 4, the attention sinks excluded), rotated by RoPE averaged over the next ``n_future_positions``
positions (``R = mean_d R(p + d)``; ``mu' = R mu``, ``Sigma' = R Sigma R^T``). The expected unnormalised attention
of a key is ``E[exp(q.k / sqrt(d))] = exp(mu'.k / sqrt(d) + k^T Sigma' k / (2 d))``; scores are its softmax over the
layer's new entries, averaged over each GQA group, then ``(score + epsilon) * ||v||_2`` (``use_vnorm``). The first
``n_sink`` entries are always kept. Query-agnostic: nothing of a question is seen.

kvforge specifics: the query moments are summed by the attention hooks during the ordinary prefill (one extra
``q_proj`` per layer, no S x S attention); the RoPE step angles are read off the layer's own cos/sin (any base or
scaling, no rotary module needed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvforge.presses.base import ScorerPress
from kvforge.presses.layer import LayerContext, Needs


def averaged_rope(angles: Tensor, last: int, n_future: int) -> tuple[Tensor, Tensor]:
    """``(mean cos, mean sin)`` ``(D/2,)`` of the rotation at positions ``last + 1 ... last + n_future``."""
    steps = torch.arange(last + 1, last + 1 + n_future, device=angles.device, dtype=torch.float64)
    phase = steps[:, None] * angles.double()[None]  # (n, D/2)
    return phase.cos().mean(0).float(), phase.sin().mean(0).float()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``R x`` along the last axis for the rotate-half RoPE layout (``R = cos I + sin P``)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([cos * x1 - sin * x2, sin * x1 + cos * x2], dim=-1)


@dataclass
class ExpectedAttentionPress(ScorerPress):
    """Expected attention of future queries (Gaussian model of the prompt's queries, averaged RoPE), x ||v||."""

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_future_positions < 1 or self.n_sink < 0 or self.epsilon < 0:
            raise ValueError("n_future_positions must be >= 1, n_sink and epsilon >= 0")

    def needs(self) -> Needs:
        return Needs(window_size=2, query_stats=True)  # window 2: the last chunk holds two positions (RoPE angles)

    def score(self, ctx: LayerContext) -> Tensor:
        if ctx.query_mean is None or ctx.query_cov is None:
            raise ValueError("Expected Attention needs query statistics (run it through compress_prefill)")
        keys = ctx.keys.float()  # (B, H_kv, S, D)
        mean, cov = ctx.query_mean.float(), ctx.query_cov.float()  # (B, H, D), (B, H, D, D)
        if ctx.rope_angles is not None:
            last = int(ctx.window_positions[0, -1]) if ctx.window_positions is not None else int(ctx.positions.max())
            cos, sin = averaged_rope(ctx.rope_angles, last, self.n_future_positions)
            mean = rotate(mean, cos, sin)
            cov = rotate(rotate(cov, cos, sin).transpose(-1, -2), cos, sin)  # R Sigma R^T
        b, h_kv, _, d = keys.shape
        g = ctx.group_size
        scale = ctx.scaling if ctx.scaling is not None else d**-0.5
        k = keys[:, :, None]  # (B, H_kv, 1, S, D)
        mu = mean.view(b, h_kv, g, d)
        logits = (k @ mu[..., None]).squeeze(-1) * scale  # (B, H_kv, g, S)
        if self.use_covariance:
            sig = cov.view(b, h_kv, g, d, d)
            logits = logits + ((k @ sig) * k).sum(-1) * (scale * scale / 2)
        scores = logits.softmax(dim=-1).mean(dim=2)  # (B, H_kv, S)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * ctx.values.float().norm(dim=-1)
        sinks = ctx.positions[:, None, :] < self.n_sink
        return scores.masked_fill(sinks, float("inf"))
