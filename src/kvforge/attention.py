"""kvforge's attention function, registered with transformers' ``AttentionInterface`` under the name ``"kvforge"``.

It computes exactly what ``sdpa`` computes, but builds each layer's mask from the positions held in the
:class:`~kvforge.cache.KVCache` (passed to the model forward as ``kv_cache=``), so layers may hold different lengths
and heads different entries. Without a cache it is plain causal (or sliding-window) attention.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvforge import compat
from kvforge.cache import KVCache

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "kvforge"


def kvforge_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_cache: KVCache | None = None,
    position_ids: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Scaled dot-product attention with masks from the cache; ``query`` ``(B, H, Q, D)`` -> ``(B, Q, H, D)``.

    ``is_causal`` here means the queries are the last Q of the K keys (lower-right causal): a later chunk of a plain
    cache runs on the causal kernels, with no mask built. Masks are built once per layer and KV head.
    """
    if kv_cache is not None and hasattr(kv_cache, "attend_rows"):  # a batched step: each row on its own cache
        rows = kv_cache.attend_rows(module, query, scaling=scaling, sliding_window=sliding_window, softcap=softcap)
        return rows, None
    num_heads, q_len = query.shape[1], query.shape[2]
    layer = kv_cache.layers[module.layer_idx] if kv_cache is not None else None  # type: ignore[index]
    is_causal = False
    mask: Tensor | None
    if layer is not None and kv_cache is not None and kv_cache.query_positions is not None:
        if layer.is_plain_causal(kv_cache.query_positions):
            mask, is_causal = None, q_len > 1
        elif (bands := _window_slots(kv_cache, layer, softcap)) is not None:
            return _in_window_bands(query, key, value, bands, layer, kv_cache.query_positions, scaling), None
        else:
            mask = layer.attention_mask(kv_cache.query_positions)  # (B, 1 or H_kv, Q, K)
    else:
        mask = _plain_mask(query, key, sliding_window, attention_mask)
        is_causal = mask is None and q_len > 1 and q_len == key.shape[2]
    policy = kv_cache.policy if kv_cache is not None else None  # a decoding budget scores entries by attention
    if policy is not None and layer is not None:
        policy.observe(layer, module.layer_idx, query, key, mask, scaling, is_causal)
    hook = kv_cache.attention_hook if kv_cache is not None else None  # declared AttentionHook (APE, aux scoring)
    if hook is not None:
        return hook(module, query, key, value, per_query_head(mask, num_heads), is_causal, scaling, softcap), None
    if softcap is not None:
        scores = attention_scores(query, key, per_query_head(mask, num_heads), is_causal, scaling, softcap)  # eager
        return attend(torch.softmax(scores, dim=-1), value), None
    slots = layer.sorted_query_slots() if layer is not None and mask is not None else None
    if slots is not None and query.device.type == "cpu" and _cpu_flash_with_lse() is not None:
        return _up_to_slots(query, key, value, slots, scaling), None
    return sdpa(query, key, value, mask, is_causal, scaling), None


def per_query_head(mask: Tensor | None, num_heads: int) -> Tensor | None:
    """A ``(B, 1 or H_kv, Q, K)`` mask broadcastable to ``(B, H, Q, K)`` (GQA groups share their KV head's row)."""
    if mask is None or mask.shape[1] in (1, num_heads):
        return mask
    return mask.repeat_interleave(num_heads // mask.shape[1], dim=1)


def sdpa(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, is_causal: bool, scale: float | None
) -> Tensor:
    """Attention of ``query`` ``(B, H, Q, D)`` on ``key``/``value`` ``(B, H_kv, K, D)``; returns ``(B, Q, H, D)``.

    ``is_causal`` = the queries are the last Q keys' positions (lower-right causal, any Q <= K). ``mask`` is
    ``(B, 1 or H_kv, Q, K)`` or None. A single query (decoding) runs with each GQA group folded into one KV head's
    rows, so the group's keys are read once and a head-wise mask is used as is.
    """
    b, num_heads, q_len, d = query.shape
    h_kv, k_len = key.shape[1], key.shape[2]
    if is_causal and q_len < k_len:
        out = _lower_right_causal(query, key, value, scale)
    elif q_len == 1 and num_heads != h_kv:
        folded = query.reshape(b, h_kv, num_heads // h_kv, d)  # heads h_kv*g + i -> KV head h_kv (repeat_interleave)
        out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scale)
        return out.reshape(b, 1, num_heads, value.shape[-1])
    else:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=per_query_head(mask, num_heads),
            is_causal=is_causal and q_len > 1,
            scale=scale,
            enable_gqa=h_kv != num_heads,
        )
    return out.transpose(1, 2).contiguous()


def _lower_right_causal(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
    """Causal attention of Q queries that are the last Q of K keys: ``(B, H, Q, D)``, no mask materialised.

    On CPU: the keys before the queries (seen in full) and the queries' own block (causal) go through the flash
    kernel separately and are merged with their log-sum-exps (exact up to rounding). Elsewhere:
    ``causal_lower_right``, which CUDA's flash / memory-efficient kernels take without a mask.
    """
    q_len, k_len = query.shape[2], key.shape[2]
    gqa = key.shape[1] != query.shape[1]
    if query.device.type == "cpu" and _cpu_flash_with_lse() is not None:
        flash = _cpu_flash_with_lse()
        past = k_len - q_len
        out_past, lse_past = flash(query, key[:, :, :past], value[:, :, :past], 0.0, False, scale=scale)
        out_new, lse_new = flash(query, key[:, :, past:], value[:, :, past:], 0.0, True, scale=scale)
        return _merge(out_new, lse_new, out_past, lse_past)
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_lower_right(q_len, k_len), scale=scale, enable_gqa=gqa
    )


def _merge(out: Tensor, lse: Tensor, out_past: Tensor, lse_past: Tensor) -> Tensor:
    """Attention over two disjoint key sets from each one's output ``(B, H, Q, D)`` and log-sum-exp ``(B, H, Q)``."""
    weight = torch.sigmoid(lse_past - lse).unsqueeze(-1).to(out.dtype)  # the past keys' share of the softmax mass
    return torch.lerp(out, out_past, weight)


SLOT_GROUP = 128  # queries per group in _up_to_slots: the masked band of a group spans its first to last slot


def _up_to_slots(query: Tensor, key: Tensor, value: Tensor, slots: Tensor, scale: float | None) -> Tensor:
    """Attention of queries that see exactly the keys up to their own slot ``slots`` ``(Q,)`` (ascending): the
    same values as the positional mask, without materialising it over every key (CPU; returns ``(B, Q, H, D)``).

    A group of queries sees every key before its first slot (the flash kernel, no mask) and a band from its first
    to its last slot (a small mask, or plain causal when the group's slots are contiguous); the two parts are merged
    with their log-sum-exps (exact up to rounding), so the work follows the causal triangle, not the whole prompt.
    """
    flash = _cpu_flash_with_lse()
    at = slots.tolist()
    outs = []
    for g in range(0, len(at), SLOT_GROUP):
        first, last = at[g], at[min(g + SLOT_GROUP, len(at)) - 1]
        q = query[:, :, g : g + SLOT_GROUP]
        band_k, band_v = key[:, :, first : last + 1], value[:, :, first : last + 1]
        if last - first + 1 == q.shape[2]:  # contiguous: plain causal within the group
            out, lse = flash(q, band_k, band_v, 0.0, True, scale=scale)
        else:
            band = torch.arange(first, last + 1, device=q.device)[None, :] <= slots[g : g + SLOT_GROUP, None]
            bias = torch.zeros(band.shape, dtype=q.dtype, device=q.device).masked_fill_(~band, float("-inf"))
            out, lse = flash(q, band_k, band_v, 0.0, False, attn_mask=bias, scale=scale)
        if first > 0:
            out_past, lse_past = flash(q, key[:, :, :first], value[:, :, :first], 0.0, False, scale=scale)
            out = _merge(out, lse, out_past, lse_past)
        outs.append(out)
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _window_slots(cache: KVCache, layer: Any, softcap: float | None) -> Tensor | None:
    """The query slots of a reserved write into a sliding-window layer whose queries may attend in bands (positions
    strictly increasing; nothing else needs the full mask: no attention hook, decoding policy or softcap)."""
    reserved = cache.reserved
    if reserved is None or not reserved.strict or cache.attention_hook is not None or cache.policy is not None:
        return None
    return layer.window_query_slots() if softcap is None else None


def _in_window_bands(
    query: Tensor, key: Tensor, value: Tensor, slots: Tensor, layer: Any, query_positions: Tensor, scale: float | None
) -> Tensor:
    """Sliding-window attention of queries written to ascending ``slots`` ``(Q,)`` of a layer in strictly increasing
    position order: a group of queries attends only to the band from ``window - 1`` slots before its first slot to
    its last (entries before it are at least ``window`` positions back), with the positional mask over that band;
    the same values as the mask over every key. Returns ``(B, Q, H, D)``."""
    window = int(layer.window)
    at = slots.tolist()
    outs = []
    for g in range(0, len(at), SLOT_GROUP):
        band = slice(max(0, at[g] - window + 1), at[min(g + SLOT_GROUP, len(at)) - 1] + 1)
        allowed = layer.attention_mask(query_positions[:, g : g + SLOT_GROUP], span=band)
        q = query[:, :, g : g + SLOT_GROUP]
        outs.append(sdpa(q, key[:, :, band], value[:, :, band], allowed, False, scale))
    return torch.cat(outs, dim=1)


@functools.cache
def _cpu_flash_with_lse() -> Any:
    """torch's CPU flash-attention op (returns the log-sum-exp too) if it exists and handles GQA here, else None."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        return None
    try:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, 3, 8, generator=gen) for h in (4, 2, 2))
        out, lse = op(q, k, v, 0.0, False, scale=None)
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        ok = out.shape == ref.shape and lse.shape == q.shape[:3] and bool(torch.allclose(out, ref, atol=1e-5))
    except (RuntimeError, TypeError):
        return None
    return op if ok else None


def _plain_mask(query: Tensor, key: Tensor, sliding_window: int | None, attention_mask: Tensor | None) -> Tensor | None:
    """Causal (+ window) mask for a forward without a kvforge cache (queries are the last Q of K keys)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1
    q_len, k_len = query.shape[2], key.shape[2]
    if sliding_window is None or k_len <= sliding_window:
        return None
    q_pos = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
    k_pos = torch.arange(k_len, device=query.device)[None, :]
    return ((k_pos <= q_pos) & (q_pos - k_pos < sliding_window))[None, None]


def rotate_half(x: Tensor) -> Tensor:
    """RoPE's half rotation ``(x1, x2) -> (-x2, x1)`` on the last dim (keys re-rotated by RAG, queries by presses)."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def attention_scores(
    query: Tensor, key: Tensor, mask: Tensor | None, is_causal: bool, scaling: float | None, softcap: float | None
) -> Tensor:
    """Masked attention logits ``(B, H, Q, K)`` in fp32 (-inf where masked); ``key`` ``(B, H_kv, K, D)``."""
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, 1) if group > 1 else key
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = (query.float() @ k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        q_len, k_len = scores.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def attend(probs: Tensor, value: Tensor) -> Tensor:
    """``probs`` ``(B, H, Q, K)`` applied to ``value`` ``(B, H_kv, K, D)``; returns ``(B, Q, H, D)``."""
    group = probs.shape[1] // value.shape[1]
    v = value.repeat_interleave(group, 1) if group > 1 else value
    return (probs.to(v.dtype) @ v).transpose(1, 2).contiguous()


def register_attention() -> None:
    """Register :func:`kvforge_attention` with transformers, with sdpa's mask function (idempotent).

    kvforge switches a model to this attention only inside its own calls (:func:`kvforge_attention_scope`); the
    mask function covers a model the user switched to ``"kvforge"`` themselves: their ``model.generate`` on a
    left-padded batch gets the padding mask sdpa would get, and
    :func:`kvforge_attention` without a kvforge cache applies it exactly as sdpa does. kvforge's own forwards build
    their masks from the cache's positions and ignore it.
    """
    compat.register_attention(ATTN_IMPLEMENTATION, kvforge_attention)


@contextmanager
def kvforge_attention_scope(model: Any) -> Iterator[Any]:
    """Run ``model`` with kvforge attention inside the block and give back the user's implementation after.

    kvforge never leaves a model switched: the user's own ``model.generate`` (padded batches included) keeps the
    attention, and so the masks, it had before kvforge ran. Re-entrant (an inner scope finds "kvforge" and leaves it).
    """
    register_attention()
    with compat.attn_implementation(model, ATTN_IMPLEMENTATION):
        yield model


def use_kvforge_attention(model: Any) -> Any:
    """Register kvforge attention; the model is switched only inside kvforge calls (see kvforge_attention_scope)."""
    register_attention()
    return model
