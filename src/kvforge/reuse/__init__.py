"""REUSE: strategies that turn a prompt into a :class:`ReusePlan` (exact prefix blocks, semantic prompt match).

``REUSE`` maps the CLI names to the classes; optional dependencies (faiss, sentence-transformers) are imported only
when a semantic strategy is built.
"""

from kvforge.reuse.base import Embedder, PromptContext, ReusePlan, ReuseStrategy, miss_plan
from kvforge.reuse.prefix import PrefixReuse

REUSE: dict[str, type] = {"prefix": PrefixReuse}

__all__ = ["REUSE", "Embedder", "PrefixReuse", "PromptContext", "ReusePlan", "ReuseStrategy", "miss_plan"]
