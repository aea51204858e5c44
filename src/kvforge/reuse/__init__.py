"""REUSE: strategies that turn a prompt into a :class:`ReusePlan` (what is stored already, what is left to run).

``REUSE`` maps the names to the classes: ``prefix`` (exact prefix blocks), ``semantic`` (a similar stored prompt),
``document`` (a document, compressed query-agnostic by the request's press, stored whole), ``rag`` (RAG chunks
re-assembled with selective recomputation). Optional dependencies (faiss, sentence-transformers) are imported only
when a semantic strategy is built or used.
"""

from typing import Any

from kvforge.reuse.base import (
    Embedder,
    PromptContext,
    ReusePlan,
    ReuseStrategy,
    StoresCompressedDocuments,
    digest,
    miss_plan,
)
from kvforge.reuse.document import DocumentReuse
from kvforge.reuse.embedder import EMBEDDERS, FakeEmbedder, MiniLMEmbedder
from kvforge.reuse.prefix import PrefixReuse
from kvforge.reuse.rag import ChunkReuse
from kvforge.reuse.semantic import SemanticReuse

REUSE: dict[str, type] = {
    "prefix": PrefixReuse,
    "semantic": SemanticReuse,
    "document": DocumentReuse,
    "rag": ChunkReuse,
}


def build_reuse(
    name: str,
    store: Any,
    model_id: str,
    *,
    semantic_mode: str = "canonical",
    threshold: float | None = None,
    max_error: float | None = None,
    block_size: int = 256,
    embedder: Any = None,
    device: Any = None,
    verify_ratio: float | None = None,
    model: Any = None,
    tokenizer: Any = None,
    method: str = "naive",
    recompute_ratio: float | None = None,
) -> ReuseStrategy:
    """A strategy from its registry name (what the CLI, the server and benchmarks call).

    ``semantic``: the MiniLM embedder by default; ``threshold`` (a fixed cosine) or ``max_error`` (the bounded error
    rate, the default 0.01), ``verify_ratio`` of the lookups verified after their answer; ``rag``: needs ``model``
    and ``tokenizer`` (chunk misses are computed with them), ``method`` and ``recompute_ratio`` pick its option.
    """
    if name == "prefix":
        return PrefixReuse(store, model_id, block_size=block_size, device=device)
    if name == "document":
        return DocumentReuse(store, model_id, device=device)
    if name == "semantic":
        kwargs: dict[str, Any] = {} if verify_ratio is None else {"verify_ratio": verify_ratio}
        return SemanticReuse(
            store,
            model_id,
            embedder or MiniLMEmbedder(),
            mode=semantic_mode,  # type: ignore[arg-type]
            threshold=threshold,
            max_error=max_error,
            device=device,
            **kwargs,
        )
    if name == "rag":
        if model is None or tokenizer is None:
            raise ValueError("RAG chunk reuse computes missing chunks: it needs the model and tokenizer")
        return ChunkReuse(model, tokenizer, store, model_id, method=method, recompute_ratio=recompute_ratio)
    raise ValueError(f"unknown reuse strategy {name!r}; choose from {sorted(REUSE)}")


__all__ = [
    "EMBEDDERS",
    "REUSE",
    "ChunkReuse",
    "DocumentReuse",
    "Embedder",
    "FakeEmbedder",
    "MiniLMEmbedder",
    "PrefixReuse",
    "PromptContext",
    "ReusePlan",
    "ReuseStrategy",
    "SemanticReuse",
    "StoresCompressedDocuments",
    "build_reuse",
    "digest",
    "miss_plan",
]
