"""REUSE: strategies that turn a prompt into a :class:`ReusePlan` (exact prefix blocks, semantic prompt match).

``REUSE`` maps the CLI names to the classes; optional dependencies (faiss, sentence-transformers) are imported only
when a semantic strategy is built or used.
"""

from kvforge.reuse.base import Embedder, PromptContext, ReusePlan, ReuseStrategy, miss_plan
from kvforge.reuse.embedder import EMBEDDERS, FakeEmbedder, MiniLMEmbedder
from kvforge.reuse.prefix import PrefixReuse
from kvforge.reuse.semantic import SemanticReuse

REUSE: dict[str, type] = {"prefix": PrefixReuse, "semantic": SemanticReuse}

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
    "miss_plan",
]
