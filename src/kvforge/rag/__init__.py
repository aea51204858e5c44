"""RAG chunk KV reuse: precompute each document chunk once, assemble at question time, recompute what matters.

>>> from kvforge.rag import RagModel, make_strategy   # doctest: +SKIP
>>> rag = RagModel(model, tokenizer)
>>> prompt = rag.build_prompt(docs, "Who wrote it?")
>>> result = rag.prefill(prompt, make_strategy("cacheclip", recompute_ratio=0.2))
"""

from kvforge.rag.assemble import Assembly, assemble
from kvforge.rag.aux import AuxScorer, map_scores, select_top
from kvforge.rag.chunks import ChunkCache, DictStore, RagPrompt, build_prompt, chunk_key
from kvforge.rag.pipeline import RagModel, RagResult
from kvforge.rag.rope import RopeSpec, UnsupportedRopeError, rope_spec, rotate_keys
from kvforge.rag.strategies import (
    STRATEGIES,
    APEStrategy,
    CacheBlendStrategy,
    CacheClipStrategy,
    FullStrategy,
    NaiveStrategy,
    make_strategy,
)

__all__ = [
    "STRATEGIES", "APEStrategy", "Assembly", "AuxScorer", "CacheBlendStrategy", "CacheClipStrategy", "ChunkCache",
    "DictStore", "FullStrategy", "NaiveStrategy", "RagModel", "RagPrompt", "RagResult", "RopeSpec",
    "UnsupportedRopeError", "assemble", "build_prompt", "chunk_key", "make_strategy", "map_scores", "rope_spec",
    "rotate_keys", "select_top",
]
