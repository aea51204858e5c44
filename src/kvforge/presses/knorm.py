"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
arXiv 2406.11430): keep the entries whose keys have the LOWEST L2 norm.

Low-norm keys correlate with high attention (the paper's observation; kvpress's ``KnormPress``). Query-agnostic and
free: no queries, no extra pass. Per-head uniform budgets like every scorer press.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvforge.presses.base import ScorerPress
from kvforge.presses.layer import LayerContext


@dataclass
class KnormPress(ScorerPress):
    """Score = minus the key's L2 norm (post-RoPE: RoPE is a rotation, the norm is the same)."""

    def score(self, ctx: LayerContext) -> Tensor:
        return -ctx.keys.float().norm(dim=-1)  # (B, H_kv, S)
