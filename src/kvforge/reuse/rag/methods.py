"""The options of RAG chunk reuse (:class:`kvforge.reuse.rag.ChunkReuse`): ``full`` (reference), ``naive``, ``ape``,
``cacheblend``, ``cacheclip``.

Each option's ``select(reuse, prompt)`` assembles the stored chunks (re-rotated to their new positions) and picks the
tokens to recompute; ``ChunkReuse.plan`` turns that :class:`Selection` into a plan that ``Engine`` executes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from kvforge.cache import AttentionHook, KVCache
from kvforge.prefill import forward, sort_by_position
from kvforge.reuse.rag.assemble import Assembly, ChunkSource, build_cache, truncated
from kvforge.reuse.rag.attend import APEAttention
from kvforge.reuse.rag.aux import AuxScorer, select_top
from kvforge.reuse.rag.prompt import RagPrompt

EARLY_CHUNK_SIZE = 512  # CacheBlend's early-layer pass runs the prompt in chunks of this many tokens


def _check_ratio(ratio: float) -> None:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute_ratio must be in [0, 1], got {ratio}")


@dataclass
class Selection:
    """An assembled prompt and what to recompute: ``recompute`` ``(N,)`` bool marks cached tokens run again.

    ``overrides[l] = (keys, values)`` replaces layer l's reused KV (CacheBlend's fresh early layers);
    ``attention_hook(cache)`` builds the hook that the assembled cache attends with (APE).
    """

    assembly: Assembly
    recompute: Tensor
    overrides: dict[int, tuple[Tensor, Tensor]] | None = None
    attention_hook: Callable[[KVCache], AttentionHook] | None = None
    info: dict[str, Any] = field(default_factory=dict)


class ChunkMethod(Protocol):
    """A way of reusing chunk KV: assemble the stored chunks and pick what to recompute (``full``: no select)."""

    name: str

    def select(self, reuse: ChunkSource, prompt: RagPrompt) -> Selection: ...


def _nothing(asm: Assembly) -> Tensor:
    return torch.zeros(asm.num_tokens, dtype=torch.bool)


@dataclass
class FullStrategy:
    """Full prefill of the whole prompt (the reference: nothing reused; ``ChunkReuse.plan`` returns a miss)."""

    name: str = "full"


@dataclass
class NaiveStrategy:
    """Stored chunks concatenated (re-rotated to their offsets), no recomputation; separators + question fresh."""

    name: str = "naive"

    def select(self, reuse: ChunkSource, prompt: RagPrompt) -> Selection:
        asm = reuse.load(prompt)
        return Selection(asm, _nothing(asm))


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

    def select(self, reuse: ChunkSource, prompt: RagPrompt) -> Selection:
        asm = reuse.load(prompt, ape=True)
        p, end = asm.prefix_len, asm.prefix_len + max(len(c) for c in prompt.chunk_ids)

        def hook(cache: KVCache) -> AttentionHook:
            return APEAttention(cache, p, end, self.temperature, self.scale)

        return Selection(
            asm, _nothing(asm), attention_hook=hook, info={"temperature": self.temperature, "scale": self.scale}
        )


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

    def select(self, reuse: ChunkSource, prompt: RagPrompt) -> Selection:
        asm = reuse.load(prompt)
        check = min(self.check_layer, reuse.num_layers - 1)
        # early layers: every non-prefix token, over the prefix only
        early = build_cache(reuse.model, asm, asm.is_context)
        rest = torch.arange(asm.prefix_len, asm.num_tokens)
        device = next(reuse.model.parameters()).device
        with truncated(reuse.model, check + 1):
            for start in range(0, rest.numel(), EARLY_CHUNK_SIZE):
                part = rest[start : start + EARLY_CHUNK_SIZE]
                forward(reuse.model, asm.ids[part][None], early, position_ids=asm.positions[part][None].to(device))
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
        recompute = _nothing(asm)
        recompute[asm.context_idx[chosen]] = True
        return Selection(asm, recompute, overrides=fresh, info={"check_layer": check})


@dataclass
class CacheClipStrategy:
    """CacheClip (arXiv 2510.10129): an auxiliary model's question-to-context attention picks the top r tokens.

    Aligned windows of ``window_size`` tokens with more than ``window_threshold`` picked are recomputed whole, so
    the recomputed share can exceed r. Recomputation runs from layer 0 at the true positions. ``aux`` defaults
    to the main model itself.
    """

    recompute_ratio: float = 0.2
    aux: ChunkSource | None = None
    window_size: int = 8
    window_threshold: int = 5
    name: str = "cacheclip"
    _scorers: dict[int, AuxScorer] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _check_ratio(self.recompute_ratio)

    def _scorer(self, reuse: ChunkSource) -> AuxScorer:
        aux = self.aux if self.aux is not None else reuse
        return self._scorers.setdefault(id(aux), AuxScorer(aux))

    def warm(self, reuse: ChunkSource, prompt: RagPrompt) -> None:
        """Precompute the auxiliary model's chunks (when it will score)."""
        if 0.0 < self.recompute_ratio < 1.0:
            self._scorer(reuse).warm(prompt)

    def select(self, reuse: ChunkSource, prompt: RagPrompt) -> Selection:
        asm = reuse.load(prompt)
        recompute = _nothing(asm)
        if self.recompute_ratio >= 1.0:
            recompute |= asm.is_context  # no need to score: everything is recomputed
        elif self.recompute_ratio > 0.0:
            scores = self._scorer(reuse).score(prompt)  # (N_ctx,)
            chosen = select_top(scores, self.recompute_ratio, self.window_size, self.window_threshold)
            recompute[asm.context_idx[chosen]] = True
        return Selection(asm, recompute)


@dataclass
class FixedSelection:
    """Recompute exactly the context tokens marked in ``chosen`` ``(N_ctx,)`` bool (oracles and ablations in
    benchmarks; not a registry option)."""

    chosen: Tensor
    name: str = "fixed"

    def select(self, reuse: ChunkSource, prompt: RagPrompt) -> Selection:
        asm = reuse.load(prompt)
        if self.chosen.shape != (prompt.num_context_tokens,):
            raise ValueError(f"selection of {tuple(self.chosen.shape)} for {prompt.num_context_tokens} context tokens")
        recompute = _nothing(asm)
        recompute[asm.context_idx[self.chosen]] = True
        return Selection(asm, recompute)


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
