"""kvforge: compress, store and reuse the KV cache of any Hugging Face decoder model.

The public names are imported on first use (PEP 562), so ``import kvforge`` and ``kvforge --help`` / ``--version``
do not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Chunks": "kvforge.request",
    "Document": "kvforge.request",
    "Engine": "kvforge.engine",
    "Generation": "kvforge.types",
    "KVCache": "kvforge.cache",
    "KVLayer": "kvforge.cache",
    "KVSegment": "kvforge.types",
    "Request": "kvforge.request",
    "SamplingParams": "kvforge.decode",
    "load_model": "kvforge.model",
}

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
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvforge' has no attribute {name!r}")
