"""REUSE: strategies that turn a prompt into a :class:`ReusePlan` (exact prefix blocks, semantic prompt match).

``REUSE`` maps the CLI names to the classes; optional dependencies (faiss, sentence-transformers) are imported only
when a semantic strategy is built or used.
"""

from typing import Any

from kvforge.reuse.base import Embedder, PromptContext, ReusePlan, ReuseStrategy, miss_plan
from kvforge.reuse.embedder import EMBEDDERS, FakeEmbedder, MiniLMEmbedder
from kvforge.reuse.prefix import PrefixReuse
from kvforge.reuse.semantic import SemanticReuse

REUSE: dict[str, type] = {"prefix": PrefixReuse, "semantic": SemanticReuse}


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
    verifier: Any = None,
    verify_ratio: float | None = None,
) -> ReuseStrategy:
    """A strategy from its registry name (what the CLI and benchmarks call); the MiniLM embedder by default.

    Semantic reuse: ``threshold`` (a fixed cosine) or ``max_error`` (the bounded error rate, the default 0.01);
    ``verifier`` (e.g. ``AgreementVerifier(model, tokenizer)``) checks ``verify_ratio`` of the lookups."""
    if name == "prefix":
        return PrefixReuse(store, model_id, block_size=block_size, device=device)
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
            verifier=verifier,
            **kwargs,
        )
    raise ValueError(f"unknown reuse strategy {name!r}; choose from {sorted(REUSE)}")


__all__ = [
    "EMBEDDERS",
    "REUSE",
    "Embedder",
    "FakeEmbedder",
    "MiniLMEmbedder",
    "PrefixReuse",
    "PromptContext",
    "ReusePlan",
    "ReuseStrategy",
    "SemanticReuse",
    "build_reuse",
    "miss_plan",
]
