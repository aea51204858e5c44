"""RAG prefill strategies: ``full`` (reference), ``naive``, ``ape``, ``cacheblend``, ``cacheclip``.

Each has ``run(rag, prompt) -> RagResult`` and ``warm(rag, prompt)`` (precompute what it reuses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvforge.cache import KVCache
from kvforge.prefill import forward, prefill
from kvforge.rag.assemble import (
    RECOMPUTE_CHUNK_SIZE,
    Assembly,
    build_cache,
    recompute_tokens,
    sort_by_position,
    truncated,
)
from kvforge.rag.attend import APEAttention
from kvforge.rag.aux import AuxScorer, select_top
from kvforge.rag.chunks import RagPrompt
from kvforge.rag.pipeline import RagModel, RagResult


def _check_ratio(ratio: float) -> None:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute_ratio must be in [0, 1], got {ratio}")


def _result(name: str, rag: RagModel, asm: Assembly, recompute: torch.Tensor, cache: KVCache, logits: Any,
            **info: Any) -> RagResult:
    n_cached = int(asm.is_cached.sum())
    n_re = int((recompute & asm.is_cached).sum())
    return RagResult(cache=cache, logits=logits, strategy=name, num_tokens=asm.num_tokens, num_reused=n_cached - n_re,
                     num_recomputed=n_re, num_fresh=asm.num_tokens - n_cached, info=info)


def _run_selected(rag: RagModel, asm: Assembly, recompute: torch.Tensor,
                  overrides: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> tuple[KVCache, Any]:
    """Reused KV for everyone else, ``recompute`` + fresh tokens run from layer 0 at their true positions."""
    cache = build_cache(rag.model, asm, recompute, overrides)
    idx = (recompute | ~asm.is_cached).nonzero().flatten()
    return cache, recompute_tokens(rag.model, asm, cache, idx)


@dataclass
class FullStrategy:
    """Full prefill of the whole prompt (the reference: no reuse)."""

    chunk_size: int | None = 512
    name: str = "full"

    def warm(self, rag: RagModel, prompt: RagPrompt) -> None:
        pass

    def run(self, rag: RagModel, prompt: RagPrompt) -> RagResult:
        ids = prompt.ids()
        cache = KVCache.for_model(rag.model)
        logits = prefill(rag.model, ids, cache, chunk_size=self.chunk_size)
        n_cached = len(prompt.prefix_ids) + prompt.num_context_tokens
        return RagResult(cache=cache, logits=logits, strategy=self.name, num_tokens=len(ids), num_reused=0,
                         num_recomputed=n_cached, num_fresh=len(ids) - n_cached)


@dataclass
class NaiveStrategy:
    """Stored chunks concatenated (re-rotated to their offsets), no recomputation; separators + question fresh."""

    name: str = "naive"

    def warm(self, rag: RagModel, prompt: RagPrompt) -> None:
        rag.warm(prompt)

    def run(self, rag: RagModel, prompt: RagPrompt) -> RagResult:
        asm = rag.load(prompt)
        recompute = torch.zeros(asm.num_tokens, dtype=torch.bool)
        cache, logits = _run_selected(rag, asm, recompute)
        return _result(self.name, rag, asm, recompute, cache, logits)


@dataclass
class APEStrategy:
    """APE (arXiv 2502.05431): chunks share positions P..P+L_i-1, query attention to them with T and S.

    Departure: the inter-chunk separators are dropped (parallel contexts have no "between"); the last separator
    and the question start at ``P + max L_i``. The temperature/scale merge stays on while decoding from the cache.
    """

    temperature: float = 0.9
    scale: float = 0.9
    name: str = "ape"

    def __post_init__(self) -> None:
        if self.temperature <= 0 or self.scale <= 0:
            raise ValueError("APE temperature and scale must be > 0")

    def warm(self, rag: RagModel, prompt: RagPrompt) -> None:
        rag.warm(prompt)

    def run(self, rag: RagModel, prompt: RagPrompt) -> RagResult:
        asm = rag.load(prompt, ape=True)
        recompute = torch.zeros(asm.num_tokens, dtype=torch.bool)
        cache = build_cache(rag.model, asm, recompute)
        p = asm.prefix_len
        cache.attention_hook = APEAttention(
            cache, p, p + max(len(c) for c in prompt.chunk_ids), self.temperature, self.scale
        )
        logits = recompute_tokens(rag.model, asm, cache, asm.fresh_idx)
        return _result(self.name, rag, asm, recompute, cache, logits, temperature=self.temperature, scale=self.scale)


@dataclass
class CacheBlendStrategy:
    """CacheBlend (arXiv 2405.16444): layers 0..check_layer on all tokens, top-r KV deviation recomputed after.

    Tokens are ranked by the squared L2 distance between fresh and reused keys at ``check_layer`` (LMCache's
    rule). Selected tokens are then run from layer 0 over a cache holding fresh KV for layers <= check_layer and
    reused KV above: the same values as CacheBlend's single pass (layers <= check_layer are a full prefill), at
    the cost of recomputing check_layer + 1 layers for the selected tokens twice.
    """

    recompute_ratio: float = 0.2
    check_layer: int = 1
    name: str = "cacheblend"

    def __post_init__(self) -> None:
        _check_ratio(self.recompute_ratio)
        if self.check_layer < 0:
            raise ValueError("check_layer must be >= 0")

    def warm(self, rag: RagModel, prompt: RagPrompt) -> None:
        rag.warm(prompt)

    def run(self, rag: RagModel, prompt: RagPrompt) -> RagResult:
        asm = rag.load(prompt)
        check = min(self.check_layer, rag.num_layers - 1)
        # early layers: every non-prefix token, over the prefix only
        early = build_cache(rag.model, asm, asm.is_context)
        rest = torch.arange(asm.prefix_len, asm.num_tokens)
        device = next(rag.model.parameters()).device
        with truncated(rag.model, check + 1):
            for start in range(0, rest.numel(), RECOMPUTE_CHUNK_SIZE):
                part = rest[start : start + RECOMPUTE_CHUNK_SIZE]
                forward(rag.model, asm.ids[part][None], early, position_ids=asm.positions[part][None].to(device))
        sort_by_position(early)
        fresh = {}
        for li in range(check + 1):
            k, v, _, _ = early.layers[li].view()  # (1, H_kv, N, D): every token, in prompt order
            fresh[li] = (k[0][:, asm.cached_idx], v[0][:, asm.cached_idx])
        # deviation of context keys at the check layer
        ctx_in_cached = asm.is_context[asm.cached_idx]
        diff = (fresh[check][0][:, ctx_in_cached].float() - asm.keys[check][:, ctx_in_cached].float()).pow(2)
        deviation = diff.sum(dim=(0, 2)).cpu()  # (N_ctx,)
        chosen = select_top(deviation, self.recompute_ratio, window_size=1)
        recompute = torch.zeros(asm.num_tokens, dtype=torch.bool)
        recompute[asm.context_idx[chosen]] = True
        cache, logits = _run_selected(rag, asm, recompute, fresh)
        return _result(self.name, rag, asm, recompute, cache, logits, check_layer=check)


@dataclass
class CacheClipStrategy:
    """CacheClip (arXiv 2510.10129): an auxiliary model's question-to-context attention picks the top r tokens.

    Aligned windows of ``window_size`` tokens with more than ``window_threshold`` picked are recomputed whole, so
    the recomputed share can exceed r. Recomputation runs from layer 0 at the true positions. ``aux`` defaults
    to the main model itself.
    """

    recompute_ratio: float = 0.2
    aux: RagModel | None = None
    window_size: int = 8
    window_threshold: int = 5
    name: str = "cacheclip"
    _scorers: dict[int, AuxScorer] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _check_ratio(self.recompute_ratio)

    def _scorer(self, rag: RagModel) -> AuxScorer:
        aux = self.aux if self.aux is not None else rag
        return self._scorers.setdefault(id(aux), AuxScorer(aux))

    def warm(self, rag: RagModel, prompt: RagPrompt) -> None:
        rag.warm(prompt)
        self._scorer(rag).warm(prompt)

    def run(self, rag: RagModel, prompt: RagPrompt) -> RagResult:
        asm = rag.load(prompt)
        recompute = torch.zeros(asm.num_tokens, dtype=torch.bool)
        if self.recompute_ratio >= 1.0:
            recompute |= asm.is_context  # no need to score: everything is recomputed
        elif self.recompute_ratio > 0.0:
            scores = self._scorer(rag).score(prompt)  # (N_ctx,)
            chosen = select_top(scores, self.recompute_ratio, self.window_size, self.window_threshold)
            recompute[asm.context_idx[chosen]] = True
        cache, logits = _run_selected(rag, asm, recompute)
        return _result(self.name, rag, asm, recompute, cache, logits)


STRATEGIES: dict[str, type] = {
    "full": FullStrategy,
    "naive": NaiveStrategy,
    "ape": APEStrategy,
    "cacheblend": CacheBlendStrategy,
    "cacheclip": CacheClipStrategy,
}

RECOMPUTING = ("cacheblend", "cacheclip")


def make_strategy(name: str, recompute_ratio: float | None = None, **kwargs: Any) -> Any:
    """Build a strategy by registry name; ``recompute_ratio`` only applies to the recomputing ones."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown RAG strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    if recompute_ratio is not None and name in RECOMPUTING:
        kwargs["recompute_ratio"] = recompute_ratio
    return STRATEGIES[name](**kwargs)
