"""RAG chunk reuse, a reuse strategy: each chunk's KV stored once, re-rotated to where it lands, selected tokens
recomputed.

:class:`ChunkReuse` (``strategy.py``) plans a :class:`~kvforge.request.Chunks` prompt; its methods (``STRATEGIES``:
naive, APE, CacheBlend, CacheClip, EPIC) live in ``methods.py``; ``prompt.py`` cuts the prompt into pieces,
``chunks.py`` computes and stores chunk KV, ``assemble.py`` places it, ``kvforge.rope`` re-rotates keys, ``aux.py``
scores tokens with an auxiliary model (CacheClip), ``attend.py`` holds APE's attention.

>>> from kvforge.request import Chunks, Request   # doctest: +SKIP
>>> rag = ChunkReuse(model, tokenizer, method="cacheclip", recompute_ratio=0.2)
>>> Engine(model, tokenizer).run(Request(Chunks(docs, "Who wrote it?"), reuse=rag))
"""

from kvforge.reuse.rag.assemble import Assembly, assemble
from kvforge.reuse.rag.aux import AuxScorer, map_scores, select_top
from kvforge.reuse.rag.chunks import ChunkCache, chunk_key
from kvforge.reuse.rag.methods import (
    RECOMPUTING,
    STRATEGIES,
    APEStrategy,
    CacheBlendStrategy,
    CacheClipStrategy,
    ChunkMethod,
    EPICStrategy,
    FixedSelection,
    FullStrategy,
    NaiveStrategy,
    Selection,
    make_strategy,
)
from kvforge.reuse.rag.prompt import RagPrompt, build_prompt
from kvforge.reuse.rag.strategy import ChunkPlan, ChunkReuse

__all__ = [
    "RECOMPUTING",
    "STRATEGIES",
    "APEStrategy",
    "Assembly",
    "AuxScorer",
    "CacheBlendStrategy",
    "CacheClipStrategy",
    "ChunkCache",
    "ChunkMethod",
    "ChunkPlan",
    "ChunkReuse",
    "EPICStrategy",
    "FixedSelection",
    "FullStrategy",
    "NaiveStrategy",
    "RagPrompt",
    "Selection",
    "assemble",
    "build_prompt",
    "chunk_key",
    "make_strategy",
    "map_scores",
    "select_top",
]
