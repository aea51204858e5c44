"""The only module that touches attention internals: forward hooks on every decoder layer's ``self_attn``.

The hooks read the attention input (``hidden_states``, ``position_embeddings``) and recompute the queries of the
tokens that matter (observation window, lookahead drafts, reconstruction chunk) with the layer's own ``q_proj``,
``q_norm`` (Qwen3/Gemma3) and RoPE. Attention weights are never requested from the model and the S x S attention of
the prompt is never built: a reconstruction chunk's queries are scored in slices of ``_QUERY_SLICE``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from kvforge.attention import rotate_half
from kvforge.cache import KVCache

logger = logging.getLogger(__name__)

_QUERY_SLICE = 128  # reconstruction queries scored at once: bounds the (B, H, slice, L) temporary


def attention_modules(model: Any) -> list[nn.Module]:
    """The ``self_attn`` module of every decoder layer, in layer order (Llama, Qwen2/3, Mistral, Gemma3...)."""
    roots = [model, getattr(model, "model", None)]
    for root in roots:
        if root is None:
            continue
        for path in ("layers", "model.layers", "language_model.layers", "model.language_model.layers"):
            obj = root
            for part in path.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if isinstance(obj, nn.ModuleList) and len(obj) and hasattr(obj[0], "self_attn"):
                return [layer.self_attn for layer in obj]
    raise ValueError(f"cannot find decoder layers with self_attn in {type(model).__name__}")


def num_query_heads(module: nn.Module) -> int:
    return module.q_proj.out_features // module.head_dim  # type: ignore[union-attr,operator]


def prerope_queries(module: nn.Module, hidden_states: Tensor) -> Tensor:
    """Queries ``(B, H, Q, D)`` before RoPE (q_proj, then q_norm where the model has one)."""
    b, q, _ = hidden_states.shape
    head_dim = module.head_dim  # type: ignore[union-attr]
    queries = module.q_proj(hidden_states).view(b, q, -1, head_dim).transpose(1, 2)  # type: ignore[operator]
    q_norm = getattr(module, "q_norm", None)
    return q_norm(queries) if q_norm is not None else queries


def rope_angles(position_embeddings: tuple[Tensor, Tensor], positions: Tensor) -> Tensor | None:
    """``(D/2,)`` angle per position step of each RoPE frequency, read off two consecutive positions' cos/sin."""
    cos, sin = position_embeddings  # (B, Q, D)
    if cos.shape[1] < 2 or int(positions[0, -1] - positions[0, -2]) != 1:
        return None
    half = cos.shape[-1] // 2
    angle = torch.atan2(sin[0, -2:, :half].float(), cos[0, -2:, :half].float())
    step = angle[1] - angle[0]
    return torch.remainder(step + math.pi, 2 * math.pi) - math.pi


def compute_queries(module: nn.Module, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor]) -> Tensor:
    """Post-RoPE queries ``(B, H, Q, D)`` for ``hidden_states`` ``(B, Q, hidden)``, as the layer computes them."""
    queries = prerope_queries(module, hidden_states)
    cos, sin = position_embeddings  # (B, Q, D)
    return queries * cos[:, None] + rotate_half(queries) * sin[:, None]


class Collector:
    """Hook state: what to record for which layers, and what was recorded.

    Modes: ``"window"`` keeps the last ``window_size`` queries of the forward that ends at ``final_position``;
    ``"lookahead"`` appends every draft token's query; ``"reconstruct"`` keeps, per context entry
    (slots ``start[l]:end[l]``), the max attention received from the forward's queries.
    """

    def __init__(
        self, cache: KVCache, layers: list[int], window_size: int, final_position: int, query_stats: int = -1
    ) -> None:
        self.cache = cache
        self.query_stats = query_stats  # >= 0: sum pre-RoPE query moments of prompt positions >= this (Exp. Attention)
        self.query_moments: dict[int, tuple[Tensor, Tensor, int]] = {}
        self.rope_angles: dict[int, Tensor] = {}
        self.layers = set(layers)
        self.window_size = window_size
        self.final_position = final_position
        self.mode = "window"
        self.window_queries: dict[int, Tensor] = {}
        self.window_positions: Tensor | None = None
        self.lookahead_queries: dict[int, list[Tensor]] = {}
        self.reconstruction: dict[int, Tensor] = {}
        self.bounds: dict[int, tuple[int, int]] = {}

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        idx = int(module.layer_idx)  # type: ignore[arg-type]
        qpos = self.cache.query_positions
        if idx not in self.layers or qpos is None:
            return
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        rope = kwargs.get("position_embeddings")
        if hidden is None or rope is None:
            raise RuntimeError(f"layer {idx}: attention hook got no hidden_states/position_embeddings")
        if self.mode == "window":
            if self.query_stats >= 0:
                self._moments(idx, module, hidden, qpos)
            if int(qpos[:, -1].max()) == self.final_position:
                angles = rope_angles(rope, qpos)
                if angles is not None:
                    self.rope_angles[idx] = angles
            if self.window_size <= 0 or int(qpos[:, -1].max()) != self.final_position:
                return
            w = min(self.window_size, hidden.shape[1])
            cos, sin = rope
            self.window_queries[idx] = compute_queries(module, hidden[:, -w:], (cos[:, -w:], sin[:, -w:]))
            self.window_positions = qpos[:, -w:]
        elif self.mode == "lookahead":
            self.lookahead_queries.setdefault(idx, []).append(compute_queries(module, hidden, rope))
        else:
            self._reconstruct(idx, module, compute_queries(module, hidden, rope), qpos)

    def _moments(self, idx: int, module: nn.Module, hidden: Tensor, qpos: Tensor) -> None:
        """Running sums of pre-RoPE queries and their outer products (first query_stats positions skipped)."""
        sel = qpos[0] >= self.query_stats
        if not bool(sel.any()):
            return
        q = prerope_queries(module, hidden[:, sel]).float()  # (B, H, Q, D)
        total, outer, count = self.query_moments.get(idx, (0.0, 0.0, 0))
        self.query_moments[idx] = (total + q.sum(2), outer + q.transpose(-1, -2) @ q, count + q.shape[2])

    def _reconstruct(self, idx: int, module: nn.Module, queries: Tensor, qpos: Tensor) -> None:
        """Running max attention (B, H, S_ctx) of this chunk's queries to the context entries, slice by slice."""
        keys, _, positions, valid = self.cache.layers[idx].view()
        start, end = self.bounds[idx]
        group = queries.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1).to(queries.dtype)  # (B, H, L, D)
        pos = positions.repeat_interleave(group, dim=1)  # (B, H, L)
        ok_valid = None if valid is None else valid.repeat_interleave(group, dim=1)[:, :, None, :]
        scale = float(getattr(module, "scaling", queries.shape[-1] ** -0.5))
        best = self.reconstruction.get(idx)
        for i in range(0, queries.shape[2], _QUERY_SLICE):
            q, qp = queries[:, :, i : i + _QUERY_SLICE], qpos[:, i : i + _QUERY_SLICE]
            logits = (q @ keys.transpose(-1, -2)).float() * scale  # (B, H, q, L)
            ok = pos[:, :, None, :] <= qp[:, None, :, None]
            if ok_valid is not None:
                ok = ok & ok_valid
            probs = logits.masked_fill(~ok, float("-inf")).softmax(dim=-1)[..., start:end].amax(dim=2)
            best = probs if best is None else torch.maximum(best, probs)
        assert best is not None
        self.reconstruction[idx] = best


@contextmanager
def attention_hooks(model: Any, collector: Collector) -> Iterator[None]:
    """Register ``collector`` on every layer's ``self_attn`` for the ``with`` block; always removed on exit."""
    handles = []
    try:
        for module in attention_modules(model):
            handles.append(module.register_forward_hook(collector, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
