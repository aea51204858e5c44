"""compress_prefill: prefill a prompt while compressing the KV entries it creates, layer by layer.

Flow: chunked prefill with hooks that keep the observation window's queries (the window lies in the last chunk)
-> optional lookahead (greedy drafts on the full cache, their queries kept, drafts undone) -> optional
reconstruction pass (KVzip; undone) -> per compressed layer: build a :class:`LayerContext`, ask the press for a
:class:`Selection`, install it with ``KVLayer.replace`` (same count per head) or ``replace_masked`` (head-wise).
The returned logits are the last prompt token's, computed on the full cache (as kvpress does).

The first two stages do not depend on the press: :class:`CompressionSource` runs them once and compresses the same
prefill with any number of presses (the evaluation runner's sweep over methods x ratios).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kvforge.cache import CacheSnapshot, KVCache, KVLayer
from kvforge.prefill import DEFAULT_CHUNK_SIZE, forward, prefill
from kvforge.presses.decoding import paused
from kvforge.presses.hooks import Collector, attention_hooks, attention_modules, num_query_heads
from kvforge.presses.layer import Compressing, LayerContext, Needs, Selection, word_ids
from kvforge.presses.replay import ReplaySettings, head_scores_from_replay, header_length, replay_key, replay_scores

logger = logging.getLogger(__name__)
QUERY_SINKS = 4  # query statistics skip the first positions (attention sinks), as kvpress's Expected Attention


def compressible_layers(cache: KVCache) -> list[int]:
    """Layers a press compresses: those without a sliding window (Gemma3/Mistral local layers are already bounded)."""
    return [i for i, layer in enumerate(cache.layers) if layer.window is None]


@torch.inference_mode()
def compress_prefill(
    model: Any,
    input_ids: Tensor | list[int],
    cache: KVCache,
    press: Compressing,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    tokenizer: Any = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> Tensor:
    """Prefill ``input_ids`` ``(1, S)`` on ``cache`` and compress the S new entries of every layer with ``press``.

    Entries already in the cache (a reused prefix) are kept as they are. Returns the last token's logits ``(B, V)``.
    ``tokenizer`` is only used by KVzip to encode its "repeat the context" prompt.
    """
    budget = getattr(press, "kv_budget", None)
    size = torch.as_tensor(input_ids).shape[-1]
    active = (press.ratio() > 0 or (budget is not None and size > budget)) and bool(compressible_layers(cache))
    needs = press.needs() if active else Needs()
    source = CompressionSource(
        model, input_ids, cache, needs, chunk_size=chunk_size, tokenizer=tokenizer, on_chunk=on_chunk
    )
    source.compress(press)
    return source.logits


class CompressionSource:
    """A prompt prefilled once on ``cache``, with what presses score from collected; compress it with many presses.

    Every press compresses after the whole prefill (scores come from the full cache and the observation window's
    queries), so compressing this source with a press gives exactly what ``compress_prefill`` with that press gives,
    as long as ``needs`` covers the press's needs (the window and lookahead drafts are shared: a press with a smaller
    window or fewer drafts takes the last window queries / the first drafts). ``compress`` first restores the full
    cache (compression installs new buffers, so the full entries are never overwritten); ``restore`` alone gives the
    uncompressed cache back. Used by the evaluation runner to prefill an example once for every method and ratio.

    Attributes:
        logits: the last prompt token's logits ``(B, V)``, computed on the full cache.
        seconds: wall clock of the shared stages, ``{"prefill", "lookahead"}``.
    """

    @torch.inference_mode()
    def __init__(
        self,
        model: Any,
        input_ids: Tensor | list[int],
        cache: KVCache,
        needs: Needs,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        tokenizer: Any = None,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> None:
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        ids = ids[None] if ids.dim() == 1 else ids
        if ids.shape[0] != 1:
            raise ValueError(f"compress_prefill takes one sequence (B=1), got batch {ids.shape[0]}")
        self.model, self.cache, self.ids, self.needs = model, cache, ids, needs
        self.chunk_size, self.tokenizer = chunk_size, tokenizer
        self.layers = compressible_layers(cache)
        self.header = header_length(tokenizer, ids[0].tolist())
        self._words: Tensor | None = None  # word ids of the prompt, read once for the first press that needs them
        self.start = [layer.length for layer in cache.layers]
        final_position = cache.next_position + ids.shape[1] - 1
        window = needs.window_size if self.layers else 0
        for scorer in needs.scorers if self.layers else ():
            scorer.bind(model, tokenizer)  # load (or train once) what it needs for this model, before the prefill
        self.collector = Collector(
            cache,
            self.layers,
            window,
            final_position,
            QUERY_SINKS if needs.query_stats else -1,
            needs.scorers if self.layers else (),
        )
        clock = [time.perf_counter()]
        # a decoding budget on this cache waits: the press sees the whole prompt (it cuts it to its own budget)
        with paused(cache), attention_hooks(model, self.collector):
            # the window must lie in the last chunk; with no window keep the plain chunking (bit-identical logits)
            min_last = needs.window_size if self.layers else 0
            self.logits = prefill(model, ids, cache, chunk_size=chunk_size, min_last_chunk=min_last, on_chunk=on_chunk)
            clock.append(time.perf_counter())
            if self.layers and needs.lookahead > 0:
                _lookahead(model, cache, self.logits, needs.lookahead, self.collector)
            clock.append(time.perf_counter())
        self.seconds = {"prefill": clock[1] - clock[0], "lookahead": clock[2] - clock[1]}
        self.snapshot = CacheSnapshot(cache)
        self.info = dict(cache.info)
        self._replays: dict[tuple, tuple[dict[int, Tensor], float]] = {}  # replay setting -> (scores, seconds)

    def restore(self) -> KVCache:
        """The uncompressed cache, as the prefill left it."""
        self.snapshot.restore()
        self.cache.info = dict(self.info)
        return self.cache

    @torch.inference_mode()
    def compress(self, press: Compressing) -> KVCache:
        """Restore the full cache, then compress its prompt entries with ``press``; returns the (same) cache.

        A press with a ``kv_budget`` (:func:`kvforge.presses.build_press`) runs at the ratio that keeps that many of
        this prompt's entries per layer and KV head."""
        budget = getattr(press, "kv_budget", None)
        if budget is None:
            return self._compress(press)
        size = int(self.ids.shape[1])
        before = press.ratio()
        press.compression_ratio = max(0.0, 1.0 - budget / size) if size > budget else 0.0  # type: ignore[attr-defined]
        try:
            cache = self._compress(press)
        finally:
            press.compression_ratio = before  # type: ignore[attr-defined]
        cache.info["press"]["kv_budget"] = budget
        return cache

    def _compress(self, press: Compressing) -> KVCache:
        contexts, seconds, reused = self._contexts(press)
        cache, name = self.cache, getattr(press, "registry_name", press.name)
        clock = time.perf_counter()
        kept: list[int | None] = [None] * cache.num_layers
        selections = press.compress_all(contexts) if contexts else []
        for idx, ctx, selection in zip(self.layers, contexts, selections, strict=True):
            _check(selection, ctx, idx)
        for idx, selection in zip(self.layers, selections, strict=True):
            install(cache.layers[idx], self.start[idx], selection)
            kept[idx] = int(selection.keep.sum())
        seconds["compress"] += time.perf_counter() - clock
        cache.info["press"] = {
            "name": name,
            "compression_ratio": press.ratio(),
            "config": press.config(),
            "compressed_tokens": int(self.ids.shape[1]),
            "kept_entries_per_layer": kept,  # summed over KV heads; None = layer left as is (sliding window)
            "uncompressed_layers": [i for i in range(cache.num_layers) if i not in self.layers],
            "nbytes": cache.nbytes(),
            "seconds": {stage: round(v, 4) for stage, v in seconds.items()},  # per stage, for overhead reports
            "replay_reused": reused,  # the reconstruction ran for an earlier press of this source (not re-timed)
        }
        return cache

    @torch.inference_mode()
    def contexts(self, press: Compressing) -> list[LayerContext]:
        """What ``press`` sees of each compressed layer of the full cache (its replay run, if it needs one), without
        compressing: e.g. the scores a press would give (``press.score(ctx)``), to train a scorer on them."""
        return self._contexts(press)[0]

    def _contexts(self, press: Compressing) -> tuple[list[LayerContext], dict[str, float], bool]:
        """Restore the full cache and build the press's layer contexts; ``(contexts, stage seconds, replay reused)``."""
        cache = self.restore()
        needs, name = press.needs(), getattr(press, "registry_name", press.name)
        active = press.ratio() > 0 and bool(self.layers)
        if press.ratio() > 0 and not self.layers:
            logger.warning("every layer has a sliding window: %s compresses nothing", name)
        short = needs.window_size > self.needs.window_size or needs.lookahead > self.needs.lookahead
        short |= bool({s.key for s in needs.scorers} - {s.key for s in self.needs.scorers})
        if active and (short or (needs.query_stats and not self.needs.query_stats)):
            raise ValueError(
                f"{press.name} needs a window of {needs.window_size}, {needs.lookahead} lookahead drafts and scorers "
                f"{[s.key for s in needs.scorers]}; this prefill collected {self.needs.window_size}, "
                f"{self.needs.lookahead} and {[s.key for s in self.needs.scorers]}"
            )
        prepare = getattr(press, "prepare", None)
        if active and prepare is not None:
            prepare(self)  # e.g. KVzip head-level: load (or calibrate once) the model's head scores
            cache = self.restore()
        clock = [time.perf_counter()]
        self.collector.reconstruction = {}
        replay_seconds, reused = 0.0, False
        if active and needs.reconstruction:
            settings = needs.replay or ReplaySettings()  # presses reusing KVzip's scores replay with its defaults
            key = replay_key(settings)
            reused = key in self._replays
            if not reused:  # one replay per replay setting, shared by every press and ratio using it
                scores = self._replay(cache, settings)
                self._replays[key] = (scores, time.perf_counter() - clock[0])
            self.collector.reconstruction, replay_seconds = self._replays[key]
        clock.append(time.perf_counter())
        modules = attention_modules(self.model)
        window = needs.window_size if active else 0
        lookahead = needs.lookahead if active else 0
        contexts = [
            _layer_context(
                cache.layers[idx],
                self.start[idx],
                modules[idx],
                rank,
                len(self.layers),
                self.collector,
                idx,
                window,
                lookahead,
                self.header,
                self._word_ids() if needs.words else None,
            )
            for rank, idx in enumerate(self.layers)
        ]
        clock.append(time.perf_counter())
        seconds = {"prefill": self.seconds["prefill"], "lookahead": self.seconds["lookahead"] if lookahead else 0.0}
        # a replay shared with an earlier press reports what it cost when it ran (TTFT as if run alone)
        seconds |= {"reconstruction": replay_seconds, "compress": clock[2] - clock[1]}
        return contexts, seconds, reused

    def _word_ids(self) -> Tensor | None:
        if self._words is None and self.tokenizer is not None:
            self._words = word_ids(self.tokenizer, self.ids[0].tolist())
        return self._words

    @torch.inference_mode()
    def calibrate_heads(self, skip: int) -> list[list[float] | None]:
        """KVzip head-level calibration on this prompt: one context replay, one mean score per (layer, KV head)."""
        cache = self.restore()
        replay = self._replay(cache, ReplaySettings())
        modules = attention_modules(self.model)
        group = {i: num_query_heads(modules[i]) // cache.layers[i].keys.shape[1] for i in self.layers}
        return head_scores_from_replay(replay, cache.num_layers, group, skip)

    def _replay(self, cache: KVCache, settings: ReplaySettings) -> dict[int, Tensor]:
        return replay_scores(self.model, cache, self.ids, settings, self.tokenizer, self.chunk_size, self.start,
                             compressible_layers(cache))  # fmt: skip


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


def _layer_context(
    layer: KVLayer,
    start: int,
    module: Any,
    rank: int,
    num_layers: int,
    collector: Collector,
    idx: int,
    window_size: int,
    lookahead: int,
    header: int = 0,
    words: Tensor | None = None,
) -> LayerContext:
    """The press's view of layer ``idx``: its new entries, the last ``window_size`` window queries and the first
    ``lookahead`` draft queries collected."""
    keys, values, positions, valid = layer.view()
    window = collector.window_queries.get(idx) if window_size > 0 else None
    mean = cov = None
    if idx in collector.query_moments:
        total, outer, count = collector.query_moments[idx]
        mean = total / count
        cov = outer / count - mean[..., :, None] * mean[..., None, :]
    look = collector.lookahead_queries.get(idx, [])[:lookahead]
    scored = {
        scorer.key: scorer.finish(idx, torch.cat(per[idx], dim=-1))
        for scorer in collector.scorers
        if (per := collector.hidden_scores[scorer.key]).get(idx)
    }
    return LayerContext(
        keys=keys[:, :, start:],
        values=values[:, :, start:],
        positions=positions[:, 0, start:],  # new entries share positions across heads
        layer_idx=rank,
        num_layers=num_layers,
        num_heads=num_query_heads(module),
        scaling=float(getattr(module, "scaling", module.head_dim**-0.5)),
        window_queries=None if window is None else window[:, :, -window_size:],
        window_positions=None
        if window is None or collector.window_positions is None
        else collector.window_positions[:, -window_size:],
        lookahead_queries=None if not look else torch.cat(look, dim=2),
        reconstruction_scores=collector.reconstruction.get(idx),
        output_weight=module.o_proj.weight,
        prefix_keys=keys[:, :, :start],
        prefix_positions=positions[:, :, :start],
        prefix_valid=None if valid is None else valid[:, :, :start],
        header_length=header,
        rope_angles=collector.rope_angles.get(idx),
        model_layer=idx,
        query_mean=mean,
        query_cov=cov,
        hidden_scores=scored or None,
        words=words,
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
