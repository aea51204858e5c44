"""The only module that touches attention internals: forward hooks on every decoder layer's ``self_attn``.

The hooks read the attention input (``hidden_states``, ``position_embeddings``) and recompute the queries of the
tokens that matter (observation window, lookahead drafts) with the layer's own ``q_proj``, ``q_norm`` (Qwen3/Gemma3)
and RoPE. Attention weights are never requested from the model and the S x S attention of the prompt is never built.
KVzip's replay scores inside the attention itself (:class:`ReplayAttention`, a declared ``cache.attention_hook``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from kvforge.attention import rotate_half, sdpa
from kvforge.cache import KVCache
from kvforge.compat import attention_inputs, attention_modules

logger = logging.getLogger(__name__)


def num_query_heads(module: nn.Module) -> int:
    return module.q_proj.out_features // module.head_dim  # type: ignore[union-attr,operator]


def prerope_queries(module: nn.Module, hidden_states: Tensor) -> Tensor:
    """Queries ``(B, H, Q, D)`` before RoPE (q_proj, then q_norm where the model has one)."""
    b, q, _ = hidden_states.shape
    head_dim = module.head_dim  # type: ignore[union-attr]
    queries = module.q_proj(hidden_states).view(b, q, -1, head_dim).transpose(1, 2)  # type: ignore[operator]
    q_norm = getattr(module, "q_norm", None)
    return q_norm(queries) if q_norm is not None else queries


def rope_angles(rope: tuple[Tensor, Tensor], positions: Tensor) -> Tensor | None:
    """``(D/2,)`` angle per position step of each RoPE frequency, read off two consecutive positions' cos/sin."""
    cos, sin = rope  # (B, Q, D)
    if cos.shape[1] < 2 or int(positions[0, -1] - positions[0, -2]) != 1:
        return None
    half = cos.shape[-1] // 2
    angle = torch.atan2(sin[0, -2:, :half].float(), cos[0, -2:, :half].float())
    step = angle[1] - angle[0]
    return torch.remainder(step + math.pi, 2 * math.pi) - math.pi


def compute_queries(module: nn.Module, hidden_states: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Post-RoPE queries ``(B, H, Q, D)`` for ``hidden_states`` ``(B, Q, hidden)``, as the layer computes them."""
    queries = prerope_queries(module, hidden_states)
    cos, sin = rope  # (B, Q, D)
    return queries * cos[:, None] + rotate_half(queries) * sin[:, None]


class Collector:
    """Hook state: what to record for which layers, and what was recorded.

    Modes: ``"window"`` keeps the last ``window_size`` queries of the forward that ends at ``final_position`` and runs
    the ``scorers`` on every prompt forward; ``"lookahead"`` appends every draft token's query. ``reconstruction``
    holds KVzip's replay scores (:class:`ReplayAttention`'s), per layer ``(B, H, S)``.
    """

    def __init__(
        self,
        cache: KVCache,
        layers: list[int],
        window_size: int,
        final_position: int,
        query_stats: int = -1,
        scorers: tuple[Any, ...] = (),
    ) -> None:
        self.cache = cache
        self.scorers = scorers  # HiddenScorers run on every prompt forward (KVzap); their scores per layer below
        self.hidden_scores: dict[str, dict[int, list[Tensor]]] = {s.key: {} for s in scorers}
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

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        idx = int(module.layer_idx)  # type: ignore[arg-type]
        qpos = self.cache.query_positions
        if idx not in self.layers or qpos is None:
            return
        hidden, rope = attention_inputs(args, kwargs)
        if hidden is None or rope is None:
            raise RuntimeError(f"layer {idx}: attention hook got no hidden_states/position_embeddings")
        if self.mode == "window":
            for scorer in self.scorers:
                got = scorer(idx, hidden)
                if got is not None:
                    self.hidden_scores[scorer.key].setdefault(idx, []).append(got)
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
        else:
            self.lookahead_queries.setdefault(idx, []).append(compute_queries(module, hidden, rope))

    def _moments(self, idx: int, module: nn.Module, hidden: Tensor, qpos: Tensor) -> None:
        """Running sums of pre-RoPE queries and their outer products (first query_stats positions skipped)."""
        sel = qpos[0] >= self.query_stats
        if not bool(sel.any()):
            return
        q = prerope_queries(module, hidden[:, sel]).float()  # (B, H, Q, D)
        total, outer, count = self.query_moments.get(idx, (0.0, 0.0, 0))
        self.query_moments[idx] = (total + q.sum(2), outer + q.transpose(-1, -2) @ q, count + q.shape[2])


class ReplayAttention:
    """KVzip's replay attention, set as ``cache.attention_hook``: each layer's attention and its scores in one place.

    For the layers in ``bounds`` the running max probability each context entry (slots ``start:end``) receives from
    the forward's queries is kept in ``scores`` ``{layer: (B, H, S_ctx)}`` (per query head), without recomputing the
    queries and without a second softmax over the full ``(Q, K)`` attention: on CPU the fused attention kernel also
    returns each query's log-sum-exp, and ``log p = [q * scale, -lse] . [k, 1]`` is one matmul over the context keys
    (queries grouped per KV head: no keys repeated), followed by a max over the queries; elsewhere (CUDA, soft-capping)
    the attention is computed explicitly and its probabilities are read. Temporaries are bounded by ``max_elements``.
    Layers outside ``bounds`` (sliding-window layers) get plain attention.

    The usual replay (a plain cache continued: nothing masked but causality) runs the kernel on contiguous key ranges
    (:meth:`_segmented`): KVzip's chunk-restricted log-sum-exp is the merge of the ranges inside its softmax, so no
    mask is built and no key is read a second time. A cache that needs masks (head-wise layers, windows) takes the
    masked kernel, and the chunk's log-sum-exp is the kernel's minus the left-out keys (:meth:`_chunk_lse`).
    """

    def __init__(
        self, bounds: dict[int, tuple[int, int]], normalise: str = "all", sinks: int = 0, max_elements: int = 1 << 24
    ) -> None:
        self.bounds = bounds
        self.normalise = normalise  # "all": softmax over every key; "chunk": over sinks + chunk + replay (KVzip's)
        self.sinks = sinks
        self.chunk: tuple[int, int] | None = None  # context entries (relative to start) the current request repeats
        self.scores: dict[int, Tensor] = {}
        self.max_elements = max_elements

    def __call__(
        self, module: Any, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, is_causal: bool,
        scaling: float | None, softcap: float | None,
    ) -> Tensor:  # fmt: skip
        idx = int(module.layer_idx)
        span = self.bounds.get(idx)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if query.device.type == "cpu" and softcap is None and _FLASH_WITH_LSE is not None and mask is None:
            # the usual replay: a plain cache continued, the queries are the last rows (nothing masked but causality)
            if span is None:
                return sdpa(query, key, value, None, is_causal, scale)
            return self._segmented(idx, span, query, key, value, scale, query.shape[2] if is_causal else 0)
        if mask is None and is_causal:
            mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device)
            mask = mask.tril(key.shape[2] - query.shape[2])[None, None]
        if query.device.type == "cpu" and softcap is None and _FLASH_WITH_LSE is not None:
            bias = None
            if mask is not None:
                bias = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(~mask, -math.inf)
            out, lse = _FLASH_WITH_LSE(query, key, value, 0.0, False, attn_mask=bias, scale=scale)
            if span is not None and self.normalise == "chunk":
                lse_sub = self._chunk_lse(span, query, key, mask, scale, lse)
                if lse_sub is None:  # the chunk is a small part of the keys: score it directly
                    self._chunk_scores(idx, span, query, key, mask, scale, softcap)
                else:
                    lo, hi = self._chunk_slots(span)
                    self._log_prob_max(idx, span, query * scale, -lse_sub.to(query.dtype), key, mask, (lo, hi))
            elif span is not None:
                self._log_prob_max(idx, span, query * scale, -lse.to(query.dtype), key, mask)
            return out.transpose(1, 2).contiguous()
        if span is not None and self.normalise == "chunk":
            self._chunk_scores(idx, span, query, key, mask, scale, softcap)
            span = None
        return self._explicit(idx, span, query, key, value, mask, scale, softcap)

    def _segmented(
        self, idx: int, span: tuple[int, int], query: Tensor, key: Tensor, value: Tensor, scale: float, new: int
    ) -> Tensor:
        """Attention of queries that see every key (the last ``new`` causally), run by the CPU kernel on contiguous
        key ranges: the ranges inside KVzip's softmax (sinks, the chunk being repeated, the replay's own keys) and
        those left out (header, other chunks), merged with their log-sum-exps. The output is the full attention (exact
        up to rounding, as :func:`kvforge.attention.sdpa`'s lower-right split) and the log-sum-exp over the inside
        ranges comes for free: no mask is built and no key is read twice except by the score matmul itself."""
        past = key.shape[2] - new
        if self.normalise == "chunk":
            lo, hi = self._chunk_slots(span)
            sink = min(self.sinks, lo)
            inside, outside = [(0, sink), (lo, hi), (span[1], past)], [(sink, lo), (hi, span[1])]
        else:
            lo, hi = span
            inside, outside = [(0, past)], []
        parts_in = [_FLASH_WITH_LSE(query, key[:, :, a:b], value[:, :, a:b], 0.0, False, scale=scale)
                    for a, b in inside if b > a]  # fmt: skip
        if new:
            parts_in.append(_FLASH_WITH_LSE(query, key[:, :, past:], value[:, :, past:], 0.0, True, scale=scale))
        parts_out = [_FLASH_WITH_LSE(query, key[:, :, a:b], value[:, :, a:b], 0.0, False, scale=scale)
                     for a, b in outside if b > a]  # fmt: skip
        lse_in = _logsumexp([lse for _, lse in parts_in])
        lse_all = lse_in if not parts_out else torch.logaddexp(lse_in, _logsumexp([lse for _, lse in parts_out]))
        out: Tensor | None = None
        for part, lse in parts_in + parts_out:
            weighted = part * (lse - lse_all).exp_().unsqueeze(-1).to(part.dtype)
            out = weighted if out is None else out.add_(weighted)
        assert out is not None
        chunk = (lo, hi) if self.normalise == "chunk" else None
        self._log_prob_max(idx, span, query * scale, -lse_in.to(query.dtype), key, None, chunk)
        return out.transpose(1, 2).contiguous()

    def _keep(self, idx: int, got: Tensor) -> None:
        best = self.scores.get(idx)
        self.scores[idx] = got if best is None else torch.maximum(best, got)

    def _chunk_slots(self, span: tuple[int, int]) -> tuple[int, int]:
        return (span[0], span[1]) if self.chunk is None else (span[0] + self.chunk[0], span[0] + self.chunk[1])

    def _chunk_lse(
        self, span: tuple[int, int], query: Tensor, key: Tensor, mask: Tensor | None, scale: float, lse: Tensor
    ) -> Tensor | None:
        """Log-sum-exp over sinks + chunk + replay keys, from the kernel's over all keys minus the keys left out
        (template header, other chunks): ``log(exp(lse) - sum_out exp(x))``; None when that is not the cheap way (the
        left-out keys outnumber the kept ones, are masked for some query, or hold over 99.9% of the attention)."""
        lo, hi = self._chunk_slots(span)
        sink = min(self.sinks, lo)
        out = torch.cat([torch.arange(sink, lo), torch.arange(hi, span[1])]).to(key.device)
        if out.numel() == 0:
            return lse
        if out.numel() > key.shape[2] - out.numel() or (mask is not None and not bool(mask.index_select(3, out).all())):
            return None
        b, h, q, d = query.shape
        h_kv, g = key.shape[1], h // key.shape[1]
        logits = query.reshape(b, h_kv, g * q, d) @ key.index_select(2, out).transpose(-1, -2)
        left = logits.float().mul_(scale).logsumexp(dim=-1).view(b, h, q).double() - lse.double()  # log share left out
        if bool((left > -1e-3).any()):
            return None
        return (lse.double() + torch.log1p(-left.exp())).float()

    def _log_prob_max(
        self, idx: int, span: tuple[int, int], query: Tensor, neg_lse: Tensor, key: Tensor, mask: Tensor | None,
        cols: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        """Max over queries of ``exp(scale q.k - lse)`` for the context keys (or the slots ``cols`` of them): one
        (D+1)-wide matmul. Unmasked (the usual case) it runs per block of keys, the keys as rows and every query of the
        GQA group as columns, so each block's ``(keys, queries)`` product stays in cache and the max is a reduction
        over contiguous memory (2-3x faster on CPU than one ``(queries, keys)`` product reduced over its rows)."""
        b, h, q, d = query.shape
        h_kv, g = key.shape[1], h // key.shape[1]
        lo, hi = cols if cols is not None else span
        ctx = key[:, :, lo:hi]
        keys = torch.cat([ctx, ctx.new_ones(*ctx.shape[:3], 1)], dim=-1)  # (B, H_kv, S, D+1)
        grouped = torch.cat([query, neg_lse[..., None]], dim=-1).view(b, h_kv, g, q, d + 1)
        hidden = None if mask is None else ~mask[..., lo:hi]
        if hidden is not None and not bool(hidden.any()):
            hidden = None  # the context is visible to every replay query (the usual case)
        if cols is not None and idx not in self.scores:
            self.scores[idx] = query.new_zeros(b, h, span[1] - span[0], dtype=torch.float32)
        if hidden is None:
            columns = grouped.permute(0, 1, 4, 2, 3).reshape(
                b, h_kv, d + 1, g * q
            )  # column j: head j // q, query j % q
            best = keys.new_empty(b, h_kv, hi - lo, g)
            step = max(8, min(self.max_elements, 1 << 18) // max(1, g * q))
            for i in range(0, hi - lo, step):
                block = keys[:, :, i : i + step] @ columns  # (B, H_kv, n, g * q)
                torch.amax(block.view(b, h_kv, -1, g, q), dim=-1, out=best[:, :, i : i + step])
            self._merge(idx, span, cols, best.permute(0, 1, 3, 2).reshape(b, h, -1).float().exp_())
            return
        keys_t = keys.transpose(-1, -2)  # (B, H_kv, D+1, S)
        step = max(1, self.max_elements // max(1, h * ctx.shape[2]))
        for i in range(0, q, step):
            n = min(step, q - i)
            log_p = (grouped[:, :, :, i : i + n].reshape(b, h_kv, g * n, d + 1) @ keys_t).float()
            log_p = log_p.view(b, h_kv, g, n, -1)
            sub = hidden[..., i : i + n, :]
            log_p.masked_fill_(sub.view(b, h_kv, g, n, -1) if sub.shape[1] == h else sub[:, :, None], -math.inf)
            self._merge(idx, span, cols, log_p.amax(dim=3).reshape(b, h, -1).exp_())

    def _merge(self, idx: int, span: tuple[int, int], cols: tuple[int, int] | None, got: Tensor) -> None:
        """Running max of the scores: over the whole context (``cols`` None) or the slots ``cols`` of it."""
        if cols is None:
            self._keep(idx, got)
        else:
            part = self.scores[idx][:, :, cols[0] - span[0] : cols[1] - span[0]]
            torch.maximum(part, got, out=part)

    def _chunk_scores(
        self, idx: int, span: tuple[int, int], query: Tensor, key: Tensor, mask: Tensor | None, scale: float,
        softcap: float | None,
    ) -> None:  # fmt: skip
        """KVzip's scoring: softmax over the sinks, the chunk being repeated and the replay's own keys only; the max
        over queries lands on the chunk's entries (the other context entries keep what earlier chunks gave them)."""
        b, h, q, d = query.shape
        h_kv, g = key.shape[1], h // key.shape[1]
        lo, hi = self._chunk_slots(span)
        sink = min(self.sinks, lo)
        cols = torch.cat([torch.arange(sink), torch.arange(lo, hi), torch.arange(span[1], key.shape[2])]).to(key.device)
        sub = key.index_select(2, cols)
        if mask is not None:
            mask = mask.index_select(3, cols)
            mask = mask.view(b, h_kv, g, q, -1) if mask.shape[1] == h and h > 1 else mask[:, :, None]
        grouped = query.view(b, h_kv, g, q, d)
        best = self.scores.get(idx)
        if best is None:
            best = query.new_zeros(b, h, span[1] - span[0], dtype=torch.float32)
        part = best[:, :, lo - span[0] : hi - span[0]]
        step = max(1, self.max_elements // max(1, h * cols.numel()))
        for i in range(0, q, step):
            n = min(step, q - i)
            logits = (grouped[:, :, :, i : i + n].reshape(b, h_kv, g * n, d) @ sub.transpose(-1, -2)).float()
            logits = logits.mul_(scale).view(b, h_kv, g, n, -1)
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            if mask is not None:
                logits.masked_fill_(~mask[..., i : i + n, :], -math.inf)
            got = logits.softmax(dim=-1)[..., sink : sink + hi - lo].amax(dim=3).reshape(b, h, -1)
            torch.maximum(part, got, out=part)
        self.scores[idx] = best

    def _explicit(
        self, idx: int, span: tuple[int, int] | None, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
        scale: float, softcap: float | None,
    ) -> Tensor:  # fmt: skip
        """Logits, softmax and values spelled out (any device, soft-capping); probabilities read off for scoring."""
        b, h, q, d = query.shape
        h_kv, k_len = key.shape[1], key.shape[2]
        g = h // h_kv
        if mask is not None:  # (B, 1 or H, Q, K) -> (B, H_kv or 1, g or 1, Q, K)
            mask = mask.view(b, h_kv, g, q, k_len) if mask.shape[1] == h and h > 1 else mask[:, :, None]
        grouped = query.view(b, h_kv, g, q, d)
        out = value.new_empty(b, h_kv, g, q, value.shape[-1])
        step = max(1, self.max_elements // max(1, h * k_len))
        for i in range(0, q, step):
            n = min(step, q - i)
            logits = (grouped[:, :, :, i : i + n].reshape(b, h_kv, g * n, d) @ key.transpose(-1, -2)).float()
            logits = logits.mul_(scale).view(b, h_kv, g, n, k_len)
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            if mask is not None:
                logits.masked_fill_(~mask[..., i : i + n, :], -math.inf)
            probs = logits.softmax(dim=-1)
            if span is not None:
                self._keep(idx, probs[..., span[0] : span[1]].amax(dim=3).reshape(b, h, -1))
            probs = probs.to(value.dtype).view(b, h_kv, g * n, k_len)
            out[:, :, :, i : i + n] = (probs @ value).view(b, h_kv, g, n, -1)
        return out.view(b, h, q, -1).transpose(1, 2).contiguous()


def _logsumexp(lses: list[Tensor]) -> Tensor:
    return lses[0] if len(lses) == 1 else torch.stack(lses).logsumexp(dim=0)


# the CPU fused attention kernel that also returns each query's log-sum-exp (what sdpa runs on CPU)
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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
