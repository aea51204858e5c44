"""kvforge: compress, store and reuse the KV cache of any Hugging Face decoder model."""

from kvforge.cache import KVCache, KVLayer
from kvforge.types import Generation, KVSegment

__version__ = "0.1.0"

__all__ = ["Generation", "KVCache", "KVLayer", "KVSegment", "__version__"]
