"""kvforge: compress, store and reuse the KV cache of any Hugging Face decoder model.

The public names are imported on first use (PEP 562), so ``import kvforge`` and ``kvforge --help`` / ``--version``
do not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvforge.cache import KVCache, KVLayer
    from kvforge.decode import SamplingParams
    from kvforge.engine import Engine
    from kvforge.model import load_model
    from kvforge.request import Chunks, Document, Request
    from kvforge.types import Generation, KVSegment

__version__ = "0.1.0"

__all__ = [
    "Chunks",
    "Document",
    "Engine",
    "Generation",
    "KVCache",
    "KVLayer",
    "KVSegment",
    "Request",
    "SamplingParams",
    "__version__",
    "load_model",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvforge' has no attribute {name!r}")
    from kvforge.cache import KVCache, KVLayer
    from kvforge.decode import SamplingParams
    from kvforge.engine import Engine
    from kvforge.model import load_model
    from kvforge.request import Chunks, Document, Request
    from kvforge.types import Generation, KVSegment

    public = dict(Chunks=Chunks, Document=Document, Engine=Engine, Generation=Generation, KVCache=KVCache,
                  KVLayer=KVLayer, KVSegment=KVSegment, Request=Request, SamplingParams=SamplingParams,
                  load_model=load_model)  # fmt: skip
    globals().update(public)
    return public[name]
