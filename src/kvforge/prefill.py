"""Run tokens through the model on a :class:`~kvforge.cache.KVCache`: one forward, or a chunked prefill."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kvforge import compat
from kvforge.attention import kvforge_attention_scope
from kvforge.cache import KVCache, KVReady

DEFAULT_CHUNK_SIZE = 512


@functools.cache
def masks_from_cache(device: torch.device) -> Tensor:
    """The ``attention_mask`` kvforge hands the model: a (1, 1, 1, 1) boolean placeholder on ``device``.

    kvforge's forwards build every mask from the cache's positions (kvforge.attention). Handing the model an already
    "prepared" 4D mask makes transformers skip its own mask construction for them (which would need the cache's sizes
    and cost a (Q, K) mask per forward); kvforge_attention ignores it whenever a kvforge cache is passed. It lives on
    the model's input device (one per device, made once), so no model code ever meets a CPU tensor beside CUDA ones;
    made outside inference mode so that a forward with autograd may use it too."""
    with torch.inference_mode(False):
        return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


def _as_batch(input_ids: Tensor | list[int]) -> Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    return ids[None] if ids.dim() == 1 else ids


@torch.inference_mode()
def forward(
    model: Any,
    input_ids: Tensor | list[int],
    cache: KVCache,
    *,
    logits_to_keep: int = 1,
    position_ids: Tensor | None = None,
    **model_kwargs: Any,
) -> Tensor:
    """One forward of ``input_ids`` ``(B, S)`` on top of ``cache``; returns the last ``logits_to_keep`` logits.

    Positions continue from ``cache.next_position`` (tokens processed), whatever the cache holds, unless
    ``position_ids`` ``(B, S)`` are given (RAG re-assembly places tokens explicitly).
    """
    ids = _as_batch(input_ids).to(model.device)
    b, s = ids.shape
    if s == 0:
        raise ValueError("forward needs at least one token")
    if position_ids is None:
        position_ids = torch.arange(cache.next_position, cache.next_position + s, device=ids.device)[None].expand(b, -1)
    cache.begin(position_ids)
    try:
        out = call_model(model, ids, position_ids, cache, logits_to_keep, **model_kwargs)
    except KVReady:  # the entries up to cache.stop_after are written: nothing after them was asked for (no logits)
        cache.end(ids)
        return ids.new_empty((b, 0, 0), dtype=torch.float32)
    except BaseException:
        cache.abort()  # roll back the entries this forward appended: the cache stays usable
        raise
    cache.end(ids)
    return out.logits


def call_model(
    model: Any, input_ids: Tensor, position_ids: Tensor, cache: Any, logits_to_keep: int, **model_kwargs: Any
) -> Any:
    """The model's forward on a kvforge cache (a :class:`KVCache`, or a batched view of several) with kvforge's
    attention, which builds its masks from the cache's positions (the model's own mask construction is skipped)."""
    with kvforge_attention_scope(model):
        return model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=True,
            **compat.cache_arg(model, cache),
            kv_cache=cache,
            logits_to_keep=logits_to_keep,
            **({"attention_mask": masks_from_cache(input_ids.device)} | model_kwargs),
        )


def prefill(
    model: Any,
    input_ids: Tensor | list[int],
    cache: KVCache,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    on_chunk: Callable[[int, int], None] | None = None,
    min_last_chunk: int = 0,
) -> Tensor:
    """Prefill ``input_ids`` in chunks of ``chunk_size`` tokens (None = one shot); returns the last token's logits.

    Activation memory is bounded by the chunk size. ``min_last_chunk`` makes the final chunk at least that long
    (presses score the observation window from the last chunk's hidden states).
    ``on_chunk(done, total)`` is called after each chunk (progress bars).
    """
    ids = _as_batch(input_ids)
    total = ids.shape[1]
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    bounds = _chunk_bounds(total, chunk_size or total, min_last_chunk)
    logits: Tensor | None = None
    for start, end in bounds:
        logits = forward(model, ids[:, start:end], cache, logits_to_keep=1)
        if on_chunk is not None:
            on_chunk(end, total)
    assert logits is not None
    return logits[:, -1]


def prefill_at(
    model: Any,
    input_ids: Tensor | list[int],
    positions: Tensor | list[int],
    cache: KVCache,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Prefill tokens at explicit RoPE ``positions`` (ascending) over a cache holding the other positions.

    kvforge attention masks by position, so each token attends exactly to the entries at positions <= its own,
    whatever order they were added in (RAG: assembled chunk KV + the tokens selected for recomputation). When the
    cache reserved slots for exactly these tokens (``cache.reserved``, a RAG plan's cache), their entries are written
    there and a query chunk attends only to the entries up to its last slot (in a cache in position order); else they
    are appended and every layer is sorted by position afterwards. ``next_position`` follows the largest position.
    Returns the last logits.
    """
    return _prefill_at(model, input_ids, positions, cache, chunk_size)[:, -1]


def kv_through(
    model: Any,
    input_ids: Tensor | list[int],
    positions: Tensor | list[int],
    cache: KVCache,
    layer: int,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> None:
    """:func:`prefill_at` that computes only the entries of layers ``0..layer``: each forward stops once ``layer``'s
    keys and values are written, so that layer's attention and MLP and every later layer never run (CacheBlend's
    check pass needs the check layer's keys, not its output). The entries equal :func:`prefill_at`'s."""
    cache.stop_after = layer
    try:
        _prefill_at(model, input_ids, positions, cache, chunk_size)
    finally:
        cache.stop_after = None


def _prefill_at(
    model: Any, input_ids: Tensor | list[int], positions: Tensor | list[int], cache: KVCache, chunk_size: int | None
) -> Tensor:
    ids = _as_batch(input_ids)
    pos = torch.as_tensor(positions, dtype=torch.long).reshape(1, -1)
    if ids.shape != pos.shape:
        raise ValueError(f"{ids.shape[1]} tokens but {pos.shape[1]} positions")
    if pos.numel() == 0:
        raise ValueError("prefill needs at least one token")
    reserved = cache.reserved
    if reserved is not None and not torch.equal(reserved.positions.cpu(), pos[0]):
        raise ValueError("the tokens to prefill are not the ones whose slots the cache reserved")
    step = chunk_size or pos.shape[1]
    logits: Tensor | None = None
    for start in range(0, pos.shape[1], step):
        part = slice(start, start + step)
        if reserved is not None:
            slots = reserved.slots[part]
            cache.write_slots = slots.to(model.device)
            cache.num_visible = int(slots.max()) + 1 if reserved.in_order else None
        try:
            logits = forward(model, ids[:, part], cache, position_ids=pos[:, part].to(model.device))
        finally:
            cache.write_slots, cache.num_visible = None, None
    assert logits is not None
    if reserved is None:
        sort_by_position(cache)
    else:  # every slot written, in prompt order: a layer in position order decodes on the plain causal path
        cache.reserved = None
        for layer in cache.layers:
            layer.written()
    cache.next_position = max(cache.next_position, int(pos.max()) + 1)
    return logits


def sort_by_position(cache: KVCache) -> None:
    """Reorder every layer's entries by position (tokens prefilled at explicit positions were appended last)."""
    for layer in cache.layers:
        k, v, pos, _ = layer.view()
        p = pos[0, 0]
        if bool((p[1:] >= p[:-1]).all()):
            continue
        order = p.argsort(stable=True)
        layer.replace(k[:, :, order], v[:, :, order], pos[:, :, order])


def _chunk_bounds(total: int, chunk_size: int, min_last_chunk: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``total`` tokens; the last chunk holds >= min(min_last_chunk, total)."""
    if total == 0:
        raise ValueError("prefill needs at least one token")
    last = min(total, max(min_last_chunk, total - ((total - 1) // chunk_size) * chunk_size))
    bounds = [(s, min(s + chunk_size, total - last)) for s in range(0, total - last, chunk_size)]
    return [b for b in bounds if b[1] > b[0]] + [(total - last, total)]
