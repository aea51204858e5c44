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
        self, docs: list[str], question: str, system: str | None = None, separator: str = "\n\n"
    ) -> RagPrompt:
        return build_prompt(self.tokenizer, docs, question, system, separator)

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

    def prefill(self, prompt: RagPrompt, strategy: Any) -> RagResult:
        """Run ``strategy`` (see :data:`kvforge.rag.STRATEGIES`) on ``prompt``; ``ttft_s`` is its wall time."""
        start = time.perf_counter()
        with torch.inference_mode():
            result = strategy.run(self, prompt)
        result.ttft_s = time.perf_counter() - start
        logger.debug("%s: %d tokens, %d reused, %d recomputed, %.3fs", result.strategy, result.num_tokens,
                     result.num_reused, result.num_recomputed, result.ttft_s)
        return result


@torch.inference_mode()
def greedy_decode(model: Any, tokenizer: Any, cache: KVCache, logits: Tensor, max_new_tokens: int) -> list[int]:
    """Greedy tokens from a prefilled cache until EOS or ``max_new_tokens`` (the cache is extended in place)."""
    from kvforge.prefill import forward

    eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos]) - {None}
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(logits[0].argmax())
        if nxt in stop:
            break
        out.append(nxt)
        logits = forward(model, [nxt], cache)[:, -1]
    return out
