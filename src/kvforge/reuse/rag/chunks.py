"""Chunk KV computed once and kept in a store: every chunk prefilled after the ONE shared prefix of its prompts.

Only the chunk's entries are kept (positions ``P .. P+L-1``, P = prefix length), stored under a key made of the
model fingerprint, the prefix ids and the chunk ids (:func:`chunk_key`, through :func:`kvforge.reuse.base.digest`,
kvforge's one key function). The ids are stored with the KV and checked on a hit.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvforge.cache import KVCache
from kvforge.prefill import prefill
from kvforge.reuse.base import digest, encode_ids
from kvforge.reuse.rag.prompt import RagPrompt
from kvforge.types import KVSegment

if TYPE_CHECKING:
    from kvforge.store.base import KVStore

logger = logging.getLogger(__name__)

KEY_PREFIX = "rag-v2-"


def chunk_key(model_id: str, prefix_ids: list[int], chunk_ids: list[int] | None) -> str:
    """Store key of a chunk's KV after ``prefix_ids`` (``chunk_ids=None``: the prefix's own KV)."""
    part = "prefix" if chunk_ids is None else encode_ids(chunk_ids)
    return KEY_PREFIX + digest("kvforge-rag-v2", model_id, encode_ids(prefix_ids), part)


def _text(prompt: RagPrompt, i: int) -> str | None:
    return prompt.chunk_texts[i] if i < len(prompt.chunk_texts) else None


def _memory_store() -> KVStore:
    from kvforge.store.memory import MemoryStore

    return MemoryStore()


class ChunkCache:
    """Prefix and chunk KV segments of one model, computed on a miss and kept in ``store`` (default: in memory)."""

    def __init__(self, model: Any, model_id: str, store: KVStore | None = None) -> None:
        self.model = model
        self.model_id = model_id
        self.store: KVStore = store if store is not None else _memory_store()
        self.num_hits = 0
        self.num_misses = 0

    def _lookup(self, key: str, token_ids: list[int]) -> KVSegment | None:
        seg = self.store.get(key)
        if seg is None:
            return None
        if seg.token_ids != token_ids or (seg.model_id and seg.model_id != self.model_id):
            logger.warning("stored segment %s does not hold the expected tokens/model: recomputing it", key[:12])
            return None
        return seg

    def prefix(self, prefix_ids: list[int]) -> KVSegment | None:
        """KV of the shared prefix at positions ``0..P-1`` (None for an empty prefix)."""
        if not prefix_ids:
            return None
        key = chunk_key(self.model_id, prefix_ids, None)
        seg = self._lookup(key, prefix_ids)
        if seg is None:
            cache = KVCache.for_model(self.model)
            prefill(self.model, prefix_ids, cache, chunk_size=None)
            seg = cache.to_segment(self.model_id, prefix_ids)
            seg.meta = {"kind": "rag_prefix"}
            self.store.put(key, seg)
        return seg

    def chunk(self, prefix_ids: list[int], chunk_ids: list[int], text: str | None = None) -> KVSegment:
        """KV of ``chunk_ids`` prefilled after the prefix: only the chunk's entries, positions ``P..P+L-1``.

        ``text`` (the chunk's text) is kept in the stored segment's meta, so a request may name the chunk by its key.
        """
        key = chunk_key(self.model_id, prefix_ids, chunk_ids)
        seg = self._lookup(key, chunk_ids)
        if seg is not None:
            self.num_hits += 1
            return seg
        self.num_misses += 1
        seg = self.compute_chunk(prefix_ids, chunk_ids)
        if text is not None:
            seg.meta["text"] = text
        self.store.put(key, seg)
        return seg

    def text_of(self, key: str) -> str:
        """The text of the stored chunk ``key`` (KeyError when no chunk with its text is stored there)."""
        seg = self.store.get(key)
        text = None if seg is None else seg.meta.get("text")
        if not isinstance(text, str) or (seg is not None and seg.model_id and seg.model_id != self.model_id):
            raise KeyError(key)
        return text

    def compute_chunk(self, prefix_ids: list[int], chunk_ids: list[int]) -> KVSegment:
        prefix = self.prefix(prefix_ids)
        cache = KVCache.from_segment(prefix, self.model) if prefix is not None else KVCache.for_model(self.model)
        prefill(self.model, chunk_ids, cache, chunk_size=None)  # one forward: sliding layers keep every entry
        p, n = len(prefix_ids), len(chunk_ids)
        seg = cache.to_segment(self.model_id, chunk_ids, start=p, end=p + n)
        if any(k.shape[1] != n for k in seg.keys):
            raise RuntimeError(f"a layer holds {[k.shape[1] for k in seg.keys]} entries of a {n}-token chunk")
        seg.meta = {"kind": "rag_chunk", "prefix_len": p}
        return seg

    def warm(self, prompt: RagPrompt) -> None:
        """Make sure the prefix and every chunk of ``prompt`` are stored (precompute; not part of TTFT)."""
        with torch.inference_mode():
            self.prefix(prompt.prefix_ids)
            for i, chunk in enumerate(prompt.chunk_ids):
                self.chunk(prompt.prefix_ids, chunk, _text(prompt, i))
