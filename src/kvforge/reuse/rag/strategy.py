"""RAG chunk reuse as a reuse strategy: stored chunk KV assembled at new positions, selected tokens recomputed.

``ChunkReuse.plan`` loads the prefix and chunks of a :class:`~kvforge.reuse.rag.prompt.RagPrompt` (computing and
storing the misses), re-rotates their keys to their offsets in this prompt, and lists the tokens left to run: the
ones its method recomputes (CacheBlend, CacheClip), the separators and the question, each with its position. The
engine runs that list as one step unit (:func:`kvforge.prefill.prefill_at`), then decodes the request with the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvforge.cache import KVCache
from kvforge.errors import UserError
from kvforge.model import model_fingerprint
from kvforge.reuse.base import PromptContext, ReusePlan, miss_plan
from kvforge.reuse.rag.assemble import Assembly, assemble, build_cache
from kvforge.reuse.rag.chunks import ChunkCache
from kvforge.reuse.rag.methods import ChunkMethod, FullStrategy, make_strategy
from kvforge.reuse.rag.prompt import RagPrompt, build_prompt
from kvforge.rope import RopeSpec, rope_spec
from kvforge.types import ChunkFacts

if TYPE_CHECKING:
    from kvforge.store.base import KVStore


@dataclass
class ChunkPlan(ReusePlan):
    """A RAG plan: ``cache`` holds the reused prefix/chunk entries at their new positions; ``prefill_ids`` (at
    ``prefill_positions``) are the recomputed chunk tokens, the separators and the question.

    ``prompt_ids`` is the prompt the model sees (APE drops the separators between its parallel chunks);
    ``reused_tokens`` counts prefix/chunk tokens whose stored KV is kept (in the later layers for CacheBlend).
    """

    prompt_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if not self.prefill_ids:
            raise ValueError("a reuse plan must leave at least one token to prefill (its logits start decoding)")
        if self.cache is None or self.prompt_ids is None or self.prefill_positions is None:
            raise ValueError("a chunk plan needs its assembled cache, its prompt ids and the positions to prefill")
        if len(self.prefill_positions) != len(self.prefill_ids):
            raise ValueError("one position per token to prefill")

    @property
    def token_ids(self) -> list[int]:
        return list(self.prompt_ids or [])

    @property
    def recomputed_tokens(self) -> int:
        return self.chunks.recomputed_tokens if self.chunks is not None else 0

    @property
    def fresh_tokens(self) -> int:
        return self.chunks.fresh_tokens if self.chunks is not None else 0


@dataclass(eq=False)
class ChunkReuse:
    """Reuse of per-chunk KV (RAG): each document chunk is prefilled once, after the shared prefix, and stored.

    Args:
        model, tokenizer: the model the chunks are computed with (CacheBlend runs it, CacheClip scores with it).
        store: where chunk KV lives (a :class:`kvforge.store.KVStore`; default: an in-memory store).
        model_id: fingerprint used in chunk keys (default: :func:`kvforge.model.model_fingerprint`).
        method: a :data:`kvforge.reuse.rag.STRATEGIES` option or its name (``naive``, ``ape``, ``cacheblend``,
            ``cacheclip``; ``full`` reuses nothing).
        recompute_ratio: with a method name, the share of chunk tokens that CacheBlend/CacheClip recompute.
    """

    model: Any
    tokenizer: Any
    store: KVStore | None = None
    model_id: str = ""
    method: ChunkMethod | FullStrategy | str = "naive"
    recompute_ratio: float | None = None
    on_chunk_loaded: Callable[[int, int], None] | None = None  # progress: (chunk tokens done, total)

    def __post_init__(self) -> None:
        self.model_id = self.model_id or model_fingerprint(self.model, self.tokenizer)
        self.chunks = ChunkCache(self.model, self.model_id, self.store)
        if isinstance(self.method, str):
            self.method = make_strategy(self.method, self.recompute_ratio)
        self._rope: RopeSpec | None = None

    @property
    def name(self) -> str:
        return str(self.method.name)

    @property
    def num_layers(self) -> int:
        config = self.model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return int(config.num_hidden_layers)

    @property
    def rope(self) -> RopeSpec:
        """The model's RoPE frequencies (raises UnsupportedRopeError for RoPE that cannot be re-rotated)."""
        if self._rope is None:
            self._rope = rope_spec(self.model)
        return self._rope

    def build_prompt(self, docs: Sequence[str], question: str, **options: Any) -> RagPrompt:
        """The prompt's pieces with this strategy's tokenizer (``options``: see :func:`build_prompt`)."""
        return build_prompt(self.tokenizer, list(docs), question, **options)

    def warm(self, prompt: RagPrompt) -> None:
        """Precompute and store the prefix and chunks of ``prompt`` (and the auxiliary model's, for CacheClip)."""
        if isinstance(self.method, FullStrategy):
            return
        self.chunks.warm(prompt)
        warm_method = getattr(self.method, "warm", None)  # CacheClip: the auxiliary model's chunks
        if warm_method is not None:
            warm_method(self, prompt)

    def load(self, prompt: RagPrompt, ape: bool = False) -> Assembly:
        """Fetch the prefix and chunk KV (computing misses) and place them at their positions in ``prompt``."""
        with torch.inference_mode():
            prefix = self.chunks.prefix(prompt.prefix_ids)
            segments, done, total = [], 0, sum(len(c) for c in prompt.chunk_ids)
            for i, c in enumerate(prompt.chunk_ids):  # a stored chunk is loaded, a missing one computed and stored
                text = prompt.chunk_texts[i] if prompt.chunk_texts else None
                segments.append(self.chunks.chunk(prompt.prefix_ids, c, text))
                done += len(c)
                if self.on_chunk_loaded is not None:
                    self.on_chunk_loaded(done, total)
            device = next(self.model.parameters()).device
            segments = [s.to(device) for s in segments]
            prefix = prefix.to(device) if prefix is not None else None
            return assemble(prompt, prefix, segments, self.rope, ape=ape)

    # ------------------------------------------------------------------------------------------ ReuseStrategy
    def plan(
        self, token_ids: Sequence[int], *, text: str | None = None, context: PromptContext | RagPrompt | None = None
    ) -> ReusePlan:
        """Assemble the chunks of ``context`` (the :class:`RagPrompt` whose ``ids()`` are ``token_ids``)."""
        if not isinstance(context, RagPrompt):
            raise UserError(
                "RAG chunk reuse needs the prompt's chunks: a Request whose prompt is Chunks(texts, question)"
            )
        if list(token_ids) != context.ids():
            raise ValueError("token ids are not the RAG prompt's")
        if isinstance(self.method, FullStrategy):
            return miss_plan(token_ids, method="full")
        hits, misses = self.chunks.num_hits, self.chunks.num_misses
        with torch.inference_mode():
            sel = self.method.select(self, context)
            asm = sel.assembly
            cache = build_cache(self.model, asm, sel.recompute, sel.overrides)
        if sel.attention_hook is not None:
            cache.attention_hook = sel.attention_hook(cache)
        run = (sel.recompute | ~asm.is_cached).nonzero().flatten()
        if int(run[-1]) != asm.num_tokens - 1:
            raise ValueError("the last prompt token must be run (its logits start decoding)")
        num_cached = int(asm.is_cached.sum())
        num_recomputed = int((sel.recompute & asm.is_cached).sum())
        facts = ChunkFacts(
            method=self.name,
            recompute_ratio=float(getattr(self.method, "recompute_ratio", None) or 0.0),
            chunks=len(context.chunk_ids),
            chunk_hits=self.chunks.num_hits - hits,
            chunk_misses=self.chunks.num_misses - misses,
            recomputed_tokens=num_recomputed,
            fresh_tokens=asm.num_tokens - num_cached,
        )
        return ChunkPlan(
            cache=cache,
            reused_tokens=num_cached - num_recomputed,
            prefill_ids=asm.ids[run].tolist(),
            kind="chunks",
            chunks=facts,
            info=dict(sel.info),
            prefill_positions=asm.positions[run].tolist(),
            prompt_ids=asm.ids.tolist(),
        )

    def record(self, token_ids: Sequence[int], cache: KVCache, *, text: str | None = None, context: Any = None) -> None:
        """Nothing to record: chunks are stored when first planned (each chunk's KV is computed on its own)."""
