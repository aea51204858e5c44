"""RAG chunk KV reuse mechanics: prompts split into chunks, chunk KV stored once, re-rotated, assembled, recomputed.

The strategy that ``Engine`` runs is :class:`kvforge.reuse.rag.ChunkReuse`; its options (``STRATEGIES``: naive,
APE, CacheBlend, CacheClip) live in :mod:`kvforge.rag.strategies`.

>>> from kvforge.reuse.rag import ChunkReuse   # doctest: +SKIP
>>> rag = ChunkReuse(model, tokenizer, method="cacheclip", recompute_ratio=0.2)
>>> Engine(model, tokenizer).answer_chunks(docs, "Who wrote it?", rag=rag)
"""

from kvforge.rag.assemble import Assembly, assemble
from kvforge.rag.aux import AuxScorer, map_scores, select_top
from kvforge.rag.chunks import ChunkCache, DictStore, RagPrompt, build_prompt, chunk_key
from kvforge.rag.rope import RopeSpec, UnsupportedRopeError, rope_spec, rotate_keys
from kvforge.rag.strategies import (
    STRATEGIES,
    APEStrategy,
    CacheBlendStrategy,
    CacheClipStrategy,
    ChunkMethod,
    FullStrategy,
    NaiveStrategy,
    Selection,
    make_strategy,
)

__all__ = [
    "STRATEGIES",
    "APEStrategy",
    "Assembly",
    "AuxScorer",
    "CacheBlendStrategy",
    "CacheClipStrategy",
    "ChunkCache",
    "ChunkMethod",
    "DictStore",
    "FullStrategy",
    "NaiveStrategy",
    "RagPrompt",
    "RopeSpec",
    "Selection",
    "UnsupportedRopeError",
    "assemble",
    "build_prompt",
    "chunk_key",
    "make_strategy",
    "map_scores",
    "rope_spec",
    "rotate_keys",
    "select_top",
]
