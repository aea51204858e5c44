"""The options of RAG chunk reuse (:class:`kvforge.reuse.rag.ChunkReuse`): ``full`` (reference), ``naive``, ``ape``,
``cacheblend``, ``cacheclip``, ``epic`` (and ``epic-ape``: EPIC with APE's attention merge).

Each option's ``select(reuse, prompt)`` assembles the stored chunks (re-rotated to their new positions) and picks the
tokens to recompute; ``ChunkReuse.plan`` turns that :class:`Selection` into a plan that ``Engine`` executes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from kvforge.cache import AttentionHook, KVCache
from kvforge.names import RAG_RECOMPUTING
from kvforge.prefill import kv_through
from kvforge.reuse.rag.assemble import Assembly, ChunkSource, build_cache, truncated
from kvforge.reuse.rag.attend import APEAttention
from kvforge.reuse.rag.aux import AuxScorer, check_grouping, select_top
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
    """CacheBlend (arXiv 2405.16444): KV of layers 0..check_layer for all tokens, top-r key deviation recomputed.

    The check pass runs layers before ``check_layer`` on every token and ``check_layer`` up to its keys and values
    (their attention and MLP outputs are not needed there).

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
        early = build_cache(reuse.model, asm, asm.is_context, num_layers=check + 1)
        rest = torch.arange(asm.prefix_len, asm.num_tokens)
        with truncated(reuse.model, check + 1):  # the check layer's keys are all it needs of that layer
            kv_through(reuse.model, asm.ids[rest], asm.positions[rest], early, check, chunk_size=EARLY_CHUNK_SIZE)
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

    Aligned windows of ``window_size`` tokens with more than ``window_threshold`` picked are recomputed whole
    (``grouping``, see :func:`~kvforge.reuse.rag.aux.select_top`: by default the picked tokens too, so the
    recomputed share can exceed r). Recomputation runs from layer 0 at the true positions. ``aux`` defaults to
    the main model itself; ``aux_layers`` runs only its first layers and reads the last of them.
    """

    recompute_ratio: float = 0.2
    aux: ChunkSource | None = None
    window_size: int = 8
    window_threshold: int = 5
    grouping: str = "union"
    aux_layers: int | None = None
    name: str = "cacheclip"
    _scorers: dict[int, AuxScorer] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _check_ratio(self.recompute_ratio)
        check_grouping(self.grouping)
        if self.aux_layers is not None and self.aux_layers < 1:
            raise ValueError(f"aux_layers must be >= 1, got {self.aux_layers}")

    def _scorer(self, reuse: ChunkSource) -> AuxScorer:
        aux = self.aux if self.aux is not None else reuse
        layers = None if self.aux_layers is None else min(self.aux_layers, aux.num_layers)  # a smaller model: all
        return self._scorers.setdefault(id(aux), AuxScorer(aux, layers))

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
            chosen = select_top(scores, self.recompute_ratio, self.window_size, self.window_threshold, self.grouping)
            recompute[asm.context_idx[chosen]] = True
        return Selection(asm, recompute)


DEFAULT_HEAD_TOKENS = 16  # EPIC's LegoLink recomputes a handful of tokens at each chunk's start


def head_counts(lengths: list[int], budget: int) -> list[int]:
    """Tokens to recompute at the start of each chunk: ``budget`` spread evenly over the chunks (water-filling, a
    chunk never gives more than its length; earlier chunks take the remainder), exactly ``min(budget, sum)``."""
    counts = [0] * len(lengths)
    left = min(budget, sum(lengths))
    open_ = [i for i, n in enumerate(lengths) if n > 0]
    while left > 0 and open_:
        share = max(1, left // len(open_))
        for i in list(open_):
            take = min(share, lengths[i] - counts[i], left)
            counts[i] += take
            left -= take
            if counts[i] == lengths[i]:
                open_.remove(i)
            if left == 0:
                break
    return counts


@dataclass
class EPICStrategy:
    """EPIC (arXiv 2410.15332), its static LegoLink recompute: the first tokens of every chunk are run again.

    A chunk computed on its own (after the shared prefix) treats its first tokens as attention sinks; recomputed
    at their place in the prompt they attend to the chunks before them and lose that role, while the rest of the
    chunk is reused. The selection is static (no model pass to choose), so the recompute costs only the tokens it
    runs. Sinks: the shared prefix is placed once (every chunk was computed after it), and the first chunk, which
    sits right after the prefix as when it was stored, is already exact: its tokens are recomputed only when the
    budget exceeds the other chunks.

    Budget: ``recompute_tokens`` per chunk (EPIC's k; default 16), or ``recompute_ratio`` of the context tokens in
    all (exactly ``round(r N_ctx)``, spread evenly over the chunks' starts; for the frontier at a given share).
    ``temperature``/``scale`` < 1 put APE's attention merge (:class:`APEAttention`) on the queries past the
    contexts (the chunks keep their sequential positions).
    """

    recompute_tokens: int | None = None
    recompute_ratio: float | None = None
    temperature: float = 1.0
    scale: float = 1.0
    name: str = "epic"

    def __post_init__(self) -> None:
        if self.recompute_tokens is not None and self.recompute_ratio is not None:
            raise ValueError("EPIC takes recompute_tokens (per chunk) or recompute_ratio (in all), not both")
        if self.recompute_ratio is not None:
            _check_ratio(self.recompute_ratio)
        elif self.recompute_tokens is None:
            self.recompute_tokens = DEFAULT_HEAD_TOKENS
        if self.recompute_tokens is not None and self.recompute_tokens < 0:
            raise ValueError(f"recompute_tokens must be >= 0, got {self.recompute_tokens}")
        if self.temperature <= 0 or self.scale <= 0:
            raise ValueError("APE temperature and scale must be > 0")

    def counts(self, lengths: list[int]) -> list[int]:
        """Tokens recomputed at the start of each chunk (``lengths``: the chunks' token counts, in prompt order)."""
        if self.recompute_ratio is None:
            k = int(self.recompute_tokens or 0)
            return [0] + [min(k, n) for n in lengths[1:]]
        budget = round(self.recompute_ratio * sum(lengths))
        later = head_counts(lengths[1:], budget)  # the first chunk is exact: it comes last
        return head_counts(lengths[:1], budget - sum(later)) + later

    def select(self, reuse: ChunkSource, prompt: RagPrompt) -> Selection:
        asm = reuse.load(prompt)
        recompute = _nothing(asm)
        start = asm.prefix_len
        for chunk, k in zip(prompt.chunk_ids, self.counts([len(c) for c in prompt.chunk_ids]), strict=True):
            recompute[start : start + k] = True
            start += len(chunk) + len(prompt.sep_ids)
        info: dict[str, Any] = {"head_tokens": self.recompute_tokens}
        if self.temperature == 1.0 and self.scale == 1.0:
            return Selection(asm, recompute, info=info)
        p, t, s = asm.prefix_len, self.temperature, self.scale
        end = p + prompt.num_context_tokens + len(prompt.sep_ids) * (len(prompt.chunk_ids) - 1)  # after the last chunk

        def hook(cache: KVCache) -> AttentionHook:
            return APEAttention(cache, p, end, t, s)

        return Selection(asm, recompute, attention_hook=hook, info=info | {"temperature": t, "scale": s})


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


STRATEGIES: dict[str, Callable[..., Any]] = {
    "full": FullStrategy,
    "naive": NaiveStrategy,
    "ape": APEStrategy,
    "cacheblend": CacheBlendStrategy,
    "cacheclip": CacheClipStrategy,
    "epic": EPICStrategy,
    "epic-ape": partial(EPICStrategy, temperature=0.9, scale=0.9, name="epic-ape"),
    # CacheClip's parts, for ablations: its paper's grouping (whole windows only), no grouping, and the model's
    # first eight layers as the auxiliary scorer
    "cacheclip-windows": partial(CacheClipStrategy, grouping="windows", name="cacheclip-windows"),
    "cacheclip-tokens": partial(CacheClipStrategy, grouping="none", name="cacheclip-tokens"),
    "cacheclip-l8": partial(CacheClipStrategy, aux_layers=8, name="cacheclip-l8"),
}

RECOMPUTING = RAG_RECOMPUTING


def make_strategy(name: str, recompute_ratio: float | None = None, **kwargs: Any) -> Any:
    """Build a strategy by registry name; ``recompute_ratio`` only applies to the recomputing ones."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown RAG strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    if recompute_ratio is not None and name in RECOMPUTING:
        kwargs["recompute_ratio"] = recompute_ratio
    return STRATEGIES[name](**kwargs)
