"""RagModel: a model, its tokenizer and its stored chunk KV; runs a strategy and times the prefill (TTFT)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvforge.attention import use_kvforge_attention
from kvforge.cache import KVCache
from kvforge.rag.assemble import Assembly, assemble
from kvforge.rag.chunks import ChunkCache, RagPrompt, SegmentStore, build_prompt, model_id_of
from kvforge.rag.rope import RopeSpec, rope_spec
from kvforge.types import Generation

logger = logging.getLogger(__name__)


@dataclass
class RagResult:
    """A prefilled RAG prompt: the cache, the last token's logits ``(1, V)`` and what it cost.

    ``num_reused``: prefix/chunk tokens whose stored KV was kept (in at least the later layers for CacheBlend);
    ``num_recomputed``: prefix/chunk tokens recomputed; ``num_fresh``: separators and question (always computed).
    """

    cache: KVCache
    logits: Tensor
    strategy: str
    num_tokens: int
    num_reused: int
    num_recomputed: int
    num_fresh: int
    ttft_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def recomputed_ratio(self) -> float:
        total = self.num_reused + self.num_recomputed
        return self.num_recomputed / total if total else 0.0


class RagModel:
    """Chunk-KV reuse around one model: builds prompts, keeps chunk KV in a store, assembles and re-positions it.

    Args:
        model, tokenizer: a Hugging Face causal LM (switched to kvforge attention) and its tokenizer.
        store: where chunk KV lives (a :class:`kvforge.store.KVStore`; default: in-process dict).
        model_id: fingerprint used in store keys (default: computed from the model).
    """

    def __init__(self, model: Any, tokenizer: Any, store: SegmentStore | None = None, model_id: str | None = None):
        self.model = use_kvforge_attention(model)
        self.tokenizer = tokenizer
        self.model_id = model_id or model_id_of(model, tokenizer)
        self.chunks = ChunkCache(model, self.model_id, store)
        self._rope: RopeSpec | None = None

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

    def build_prompt(
        self, docs: list[str], question: str, system: str | None = None, separator: str = "\n\n",
        answer_prefix: str = "",
    ) -> RagPrompt:
        return build_prompt(self.tokenizer, docs, question, system, separator, answer_prefix)

    def warm(self, prompt: RagPrompt) -> None:
        """Precompute and store the prefix and chunks of ``prompt`` (done before timing)."""
        self.chunks.warm(prompt)

    def load(self, prompt: RagPrompt, ape: bool = False) -> Assembly:
        """Fetch the prefix and chunk KV (computing misses) and place them at their positions in ``prompt``."""
        with torch.inference_mode():
            prefix = self.chunks.prefix(prompt.prefix_ids)
            segments = [self.chunks.chunk(prompt.prefix_ids, c) for c in prompt.chunk_ids]
            device = next(self.model.parameters()).device
            segments = [s.to(device) for s in segments]
            prefix = prefix.to(device) if prefix is not None else None
            return assemble(prompt, prefix, segments, self.rope, ape=ape)

    def answer(
        self, docs: list[str], question: str, strategy: Any, system: str | None = None, max_new_tokens: int = 64,
        separator: str = "\n\n",
    ) -> tuple[Generation, RagResult]:
        """Precompute/store the chunks, prefill with ``strategy`` (timed), decode greedily."""
        prompt = self.build_prompt(docs, question, system, separator)
        strategy.warm(self, prompt)
        result = self.prefill(prompt, strategy)
        ids = greedy_decode(self.model, self.tokenizer, result.cache, result.logits, max_new_tokens)
        gen = Generation(
            text=self.tokenizer.decode(ids, skip_special_tokens=True).strip(), token_ids=ids,
            prompt_tokens=result.num_tokens, ttft_s=result.ttft_s, decode_s=0.0,
            finish_reason="length" if len(ids) >= max_new_tokens else "stop", reused_tokens=result.num_reused,
            cache_bytes=result.cache.nbytes(),
            info={"strategy": result.strategy, "recomputed_tokens": result.num_recomputed,
                  "fresh_tokens": result.num_fresh} | result.info,
        )
        return gen, result

    def prefill(self, prompt: RagPrompt, strategy: Any) -> RagResult:
        """Run ``strategy`` (see :data:`kvforge.rag.STRATEGIES`) on ``prompt``; ``ttft_s`` is its wall time."""
        start = time.perf_counter()
        with torch.inference_mode():
            result = strategy.run(self, prompt)
        result.ttft_s = time.perf_counter() - start
        logger.debug("%s: %d tokens, %d reused, %d recomputed, %.3fs", result.strategy, result.num_tokens,
                     result.num_reused, result.num_recomputed, result.ttft_s)
        return result



def greedy_decode(model: Any, tokenizer: Any, cache: KVCache, logits: Tensor, max_new_tokens: int) -> list[int]:
    """Greedy tokens from a prefilled cache until EOS or ``max_new_tokens`` (the cache is extended in place)."""
    from kvforge.decode import decode, eos_ids

    return list(decode(model, cache, logits, max_new_tokens, eos_token_ids=eos_ids(model, tokenizer)).token_ids)
