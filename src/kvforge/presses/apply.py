"""compress_prefill: prefill a prompt while compressing the KV entries it creates, layer by layer.

Flow: chunked prefill with hooks that keep the observation window's queries (the window lies in the last chunk)
-> optional lookahead (greedy drafts on the full cache, their queries kept, drafts undone) -> optional
reconstruction pass (KVzip; undone) -> per compressed layer: build a :class:`LayerContext`, ask the press for a
:class:`Selection`, install it with ``KVLayer.replace`` (same count per head) or ``replace_masked`` (head-wise).
The returned logits are the last prompt token's, computed on the full cache (as kvpress does).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import Tensor

from kvforge.cache import CacheSnapshot, KVCache, KVLayer
from kvforge.prefill import DEFAULT_CHUNK_SIZE, forward, prefill
from kvforge.presses.base import LayerContext, Press, Selection
from kvforge.presses.hooks import Collector, attention_hooks, attention_modules, num_query_heads
from kvforge.presses.kvzip import KVzipPress

logger = logging.getLogger(__name__)


def compressible_layers(cache: KVCache) -> list[int]:
    """Layers a press compresses: those without a sliding window (Gemma3/Mistral local layers are already bounded)."""
    return [i for i, layer in enumerate(cache.layers) if layer.window is None]


@torch.inference_mode()
def compress_prefill(
    model: Any,
    input_ids: Tensor | list[int],
    cache: KVCache,
    press: Press,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    tokenizer: Any = None,
) -> Tensor:
    """Prefill ``input_ids`` ``(1, S)`` on ``cache`` and compress the S new entries of every layer with ``press``.

    Entries already in the cache (a reused prefix) are kept as they are. Returns the last token's logits ``(B, V)``.
    ``tokenizer`` is only used by KVzip to encode its "repeat the context" prompt.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[0] != 1:
        raise ValueError(f"compress_prefill takes one sequence (B=1), got batch {ids.shape[0]}")
    needs = press.needs()
    layers = compressible_layers(cache)
    if not layers:
        logger.warning("every layer has a sliding window: %s compresses nothing", press.name)
    start = [layer.length for layer in cache.layers]
    final_position = cache.next_position + ids.shape[1] - 1
    collector = Collector(cache, layers, needs.window_size, final_position)
    active = press.ratio() > 0 and bool(layers)
    clock = [time.perf_counter()]
    with attention_hooks(model, collector):
        # the window must lie in the last chunk; at ratio 0 keep the plain chunking (bit-identical logits)
        min_last = needs.window_size if active else 0
        logits = prefill(model, ids, cache, chunk_size=chunk_size, min_last_chunk=min_last)
        clock.append(time.perf_counter())
        if active and needs.lookahead > 0:
            _lookahead(model, cache, logits, needs.lookahead, collector)
        clock.append(time.perf_counter())
        if active and needs.reconstruction:
            _reconstruct(model, cache, ids, press, tokenizer, chunk_size, collector, start)
        clock.append(time.perf_counter())
    modules = attention_modules(model)
    kept: list[int | None] = [None] * cache.num_layers
    for rank, idx in enumerate(layers):
        ctx = _layer_context(cache.layers[idx], start[idx], modules[idx], rank, len(layers), collector, idx)
        selection = press.compress(ctx)
        _check(selection, ctx, idx)
        install(cache.layers[idx], start[idx], selection)
        kept[idx] = int(selection.keep.sum())
    clock.append(time.perf_counter())
    cache.info["press"] = {
        "name": getattr(press, "registry_name", press.name),
        "compression_ratio": press.ratio(),
        "config": press.config(),
        "compressed_tokens": int(ids.shape[1]),
        "kept_entries_per_layer": kept,  # summed over KV heads; None = layer left as is (sliding window)
        "uncompressed_layers": [i for i in range(cache.num_layers) if i not in layers],
        "nbytes": cache.nbytes(),
        "seconds": {  # wall clock of each stage, for overhead reports
            stage: round(b - a, 4)
            for stage, a, b in zip(
                ("prefill", "lookahead", "reconstruction", "compress"), clock, clock[1:], strict=False
            )
        },
    }
    return logits


def _lookahead(model: Any, cache: KVCache, logits: Tensor, steps: int, collector: Collector) -> None:
    """Decode ``steps`` greedy drafts on the full cache, keeping their queries; then undo them."""
    snapshot = CacheSnapshot(cache)
    collector.mode = "lookahead"
    try:
        token = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        for _ in range(steps):
            token = forward(model, token, cache)[:, -1].argmax(dim=-1, keepdim=True)
    finally:
        collector.mode = "window"
        snapshot.restore()


def _reconstruct(
    model: Any,
    cache: KVCache,
    ids: Tensor,
    press: Press,
    tokenizer: Any,
    chunk_size: int | None,
    collector: Collector,
    start: list[int],
) -> None:
    """Teacher-force "repeat the context" + the context on top; keep max attention per context entry; undo."""
    kvzip = _find(press, KVzipPress)
    prompt: list[int] = []
    if kvzip is not None and kvzip.prompt_ids is not None:
        prompt = list(kvzip.prompt_ids)
    elif tokenizer is not None and kvzip is not None:
        prompt = list(tokenizer.encode(kvzip.prompt, add_special_tokens=False))
    else:
        logger.warning("KVzip without tokenizer or prompt_ids: repeating the context without an instruction")
    context = ids[0].tolist()
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and context and context[0] == bos:
        context = context[1:]
    snapshot = CacheSnapshot(cache)
    collector.mode = "reconstruct"
    collector.bounds = {i: (start[i], cache.layers[i].length) for i in collector.layers}
    try:
        prefill(model, torch.tensor([prompt + context]), cache, chunk_size=chunk_size)
    finally:
        collector.mode = "window"
        snapshot.restore()


def _find(press: Any, cls: type) -> Any:
    while press is not None and not isinstance(press, cls):
        press = getattr(press, "press", None)
    return press


def _layer_context(
    layer: KVLayer, start: int, module: Any, rank: int, num_layers: int, collector: Collector, idx: int
) -> LayerContext:
    keys, values, positions, valid = layer.view()
    look = collector.lookahead_queries.get(idx)
    return LayerContext(
        keys=keys[:, :, start:],
        values=values[:, :, start:],
        positions=positions[:, 0, start:],  # new entries share positions across heads
        layer_idx=rank,
        num_layers=num_layers,
        num_heads=num_query_heads(module),
        scaling=float(getattr(module, "scaling", module.head_dim**-0.5)),
        window_queries=collector.window_queries.get(idx),
        window_positions=collector.window_positions,
        lookahead_queries=None if not look else torch.cat(look, dim=2),
        reconstruction_scores=collector.reconstruction.get(idx),
        output_weight=module.o_proj.weight,
        prefix_keys=keys[:, :, :start],
        prefix_positions=positions[:, :, :start],
        prefix_valid=None if valid is None else valid[:, :, :start],
    )


def _check(selection: Selection, ctx: LayerContext, idx: int) -> None:
    if tuple(selection.keep.shape) != tuple(ctx.keys.shape[:3]) or selection.keep.dtype != torch.bool:
        raise ValueError(f"layer {idx}: press returned keep {tuple(selection.keep.shape)}, want {ctx.keys.shape[:3]}")
    for t in (selection.keys, selection.values):
        if t is not None and t.shape[:3] != ctx.keys.shape[:3]:
            raise ValueError(f"layer {idx}: press returned content {tuple(t.shape)}, want {tuple(ctx.keys.shape)}")


def install(layer: KVLayer, start: int, selection: Selection) -> None:
    """Keep the prefix ``[:start]`` and the selected new entries; same count per head -> plain, else head-wise."""
    keys, values, positions, valid = layer.view()
    if selection.keys is not None:
        keys = torch.cat([keys[:, :, :start], selection.keys.to(keys.dtype)], dim=2)
    if selection.values is not None:
        values = torch.cat([values[:, :, :start], selection.values.to(values.dtype)], dim=2)
    prefix = torch.ones_like(positions[:, :, :start], dtype=torch.bool) if valid is None else valid[:, :, :start]
    keep = torch.cat([prefix, selection.keep], dim=2)  # (B, H_kv, L)
    counts = keep.sum(dim=-1)
    if valid is None and bool((counts == counts.flatten()[0]).all()):
        n = int(counts.flatten()[0])
        idx = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[..., :n]  # kept slots, in order
        layer.replace(
            keys.gather(2, idx[..., None].expand(-1, -1, -1, keys.shape[3])),
            values.gather(2, idx[..., None].expand(-1, -1, -1, values.shape[3])),
            positions.gather(2, idx),
        )
    else:
        layer.replace_masked(keys, values, positions, keep)
