"""Attention overrides for RAG: APE's context temperature/scale merge, and capture of one layer's attention.

Both are installed as ``cache.attention_hook`` (a declared :class:`~kvforge.cache.AttentionHook`) and called by
:func:`kvforge.attention.kvforge_attention` with the
mask it built from the cache positions; they compute attention eagerly (fp32 softmax).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from kvforge.attention import attend, attention_scores, sdpa
from kvforge.cache import KVCache


class APEAttention:
    """APE (arXiv 2502.05431): queries after the contexts merge context and other attention with T and S.

    Context keys are those at positions in ``[context_start, context_end)``. For a query past the contexts the
    context part gets softmax scale ``1 / (sqrt(d) T)`` and log-mass ``S * T * lse_C``, the prefix/question part
    its plain log-mass ``lse_O``: weights ``softmax([S T lse_C, lse_O])``. One softmax over adjusted logits does
    the same: context logit ``s / T + (S T - 1) lse_C``, other logit ``s``.
    """

    def __init__(self, cache: KVCache, context_start: int, context_end: int, temperature: float, scale: float) -> None:
        self.cache = cache
        self.context_start, self.context_end = context_start, context_end
        self.temperature, self.scale = temperature, scale

    def __call__(
        self, module: Any, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, is_causal: bool,
        scaling: float | None, softcap: float | None,
    ) -> Tensor:  # fmt: skip
        q_pos = self.cache.query_positions
        assert q_pos is not None
        after = q_pos[0] >= self.context_end  # (Q,) queries past the contexts
        if not is_causal and softcap is None and not bool(after.all()):  # others attend plainly: the fast kernel
            out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])  # (B, Q, H, D)
            before = (~after).nonzero().flatten()
            part = None if mask is None else mask[:, :, before]
            out[:, before] = sdpa(query[:, :, before], key, value, part, False, scaling)
            if bool(after.any()):
                rest = after.nonzero().flatten()
                part = None if mask is None else mask[:, :, rest]
                out[:, rest] = self._merged(module, query[:, :, rest], key, value, part, scaling, q_pos[:, rest])
            return out
        return self._merged(module, query, key, value, mask, scaling, q_pos, is_causal, softcap)

    def _merged(
        self, module: Any, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float | None,
        q_pos: Tensor, is_causal: bool = False, softcap: float | None = None,
    ) -> Tensor:  # fmt: skip
        """Eager attention with APE's merge for the queries (at ``q_pos`` ``(B, Q)``) past the contexts."""
        scores = attention_scores(query, key, mask, is_causal, scaling, softcap)  # (B, H, Q, K)
        _, _, pos, _ = self.cache.layers[module.layer_idx].view()  # (B, H_kv, K)
        pos = pos.repeat_interleave(query.shape[1] // pos.shape[1], 1)[:, :, None, :]  # (B, H, 1, K)
        is_ctx = (pos >= self.context_start) & (pos < self.context_end)
        t, s = self.temperature, self.scale
        ctx_logits = scores / t
        lse = torch.logsumexp(ctx_logits.masked_fill(~is_ctx, float("-inf")), dim=-1, keepdim=True)  # (B, H, Q, 1)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        adjusted = torch.where(is_ctx, ctx_logits + (s * t - 1.0) * lse, scores)
        after = (q_pos >= self.context_end)[:, None, :, None]  # (B, 1, Q, 1) queries past the contexts
        probs = torch.softmax(torch.where(after, adjusted, scores), dim=-1)
        return attend(probs, value)


class AttentionCapture:
    """Plain attention that also sums the probabilities of queries at positions >= ``min_query_position`` on the
    layer(s) ``layer_idx`` (one index or several).

    After the forward(s), :meth:`scores_by_position` gives the summed probability (over layers, heads and those
    queries) each key position received, divided by their count (mean attention).
    """

    def __init__(self, cache: KVCache, layer_idx: int | Iterable[int], min_query_position: int) -> None:
        self.cache = cache
        self.layers = {layer_idx} if isinstance(layer_idx, int) else set(layer_idx)
        self.min_query_position = min_query_position
        self._parts: list[tuple[Tensor, Tensor]] = []
        self._count = 0

    def __call__(
        self, module: Any, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, is_causal: bool,
        scaling: float | None, softcap: float | None,
    ) -> Tensor:  # fmt: skip
        probs = torch.softmax(attention_scores(query, key, mask, is_causal, scaling, softcap), dim=-1)
        if module.layer_idx in self.layers:
            q_pos = self.cache.query_positions
            assert q_pos is not None
            sel = q_pos[0] >= self.min_query_position  # (Q,)
            if bool(sel.any()):
                _, _, pos, _ = self.cache.layers[module.layer_idx].view()
                self._parts.append((pos[0, 0].clone(), probs[0][:, sel].sum(dim=(0, 1))))  # (K,), (K,)
                self._count += int(sel.sum()) * probs.shape[1]
        return attend(probs, value)

    def scores_by_position(self, num_positions: int) -> Tensor:
        """``(num_positions,)`` mean attention received per key position."""
        out = torch.zeros(num_positions)
        for pos, mass in self._parts:
            seen = pos < num_positions  # a reserved slot not written yet (masked) received nothing
            out.index_add_(0, pos[seen].cpu(), mass[seen].float().cpu())
        return out / max(self._count, 1)
