"""kvforge beside vLLM: :class:`KVForgeConnector` gives a vLLM server kvforge's persistent, shared, checked and
optionally quantised KV store (``kv_connector_module_path: "kvforge.vllm"``).

Importing this package does not import vLLM: the connector class is loaded on first use, so the pieces that do not
need vLLM (block layouts, the transfer planner, the router) work without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVForgeConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVForgeConnector":
        from kvforge.vllm.connector import KVForgeConnector

        return KVForgeConnector
    raise AttributeError(f"module 'kvforge.vllm' has no attribute {name!r}")
