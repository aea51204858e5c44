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
    model: Any = None,
    tokenizer: Any = None,
) -> ReuseStrategy:
    """A strategy from its registry name (what the CLI and benchmarks call); the MiniLM embedder by default.

    Semantic reuse: ``threshold`` (a fixed cosine) or ``max_error`` (the bounded error rate, the default 0.01);
    ``verifier`` checks ``verify_ratio`` of the lookups (with ``model``: an :class:`AgreementVerifier` on it)."""
    if name == "prefix":
        return PrefixReuse(store, model_id, block_size=block_size, device=device)
    if name == "semantic":
        check_semantic_options(threshold, max_error, verify_ratio)
        kwargs: dict[str, Any] = {} if verify_ratio is None else {"verify_ratio": verify_ratio}
        if verifier is None and model is not None and verify_ratio != 0:
            from kvforge.reuse.verify import AgreementVerifier

            verifier = AgreementVerifier(model, tokenizer)
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


def check_semantic_options(threshold: float | None, max_error: float | None, verify_ratio: float | None) -> None:
    """ValueError for semantic options out of range or given together (checked before any model loads)."""
    if threshold is not None and max_error is not None:
        raise ValueError("give a similarity threshold or a max error rate, not both")
    if threshold is not None and not -1.0 <= threshold <= 1.0:
        raise ValueError(f"threshold is a cosine similarity in [-1, 1], got {threshold}")
    if max_error is not None and not 0.0 < max_error < 1.0:
        raise ValueError(f"max error is a rate in (0, 1), got {max_error}")
    if verify_ratio is not None and not 0.0 <= verify_ratio <= 1.0:
        raise ValueError(f"verify ratio is a share in [0, 1], got {verify_ratio}")


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
    "check_semantic_options",
    "miss_plan",
]
