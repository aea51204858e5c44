"""ROUTE: semantic prompt normalisation in front of a vLLM server that runs kvforge's KV connector.

``kvforge route --upstream http://127.0.0.1:8000 --store file:///var/cache/kv`` (see :mod:`kvforge.route.app`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvforge.errors import UserError
from kvforge.route.normalize import PromptNormalizer, RouteDecision

if TYPE_CHECKING:
    from kvforge.reuse.base import Embedder
    from kvforge.store.base import KVStore


def build_normalizer(
    store: KVStore,
    model: str,
    *,
    threshold: float | None = None,
    embedder: Embedder | None = None,
    store_url: str = "the store",
) -> PromptNormalizer:
    """The normaliser for ``model`` (the path vLLM serves) on ``store``: block keys as the connector announced them,
    kvforge's semantic policy (MiniLM unless ``embedder`` is given) over the store's semantic index."""
    from kvforge.reuse import MiniLMEmbedder, PrefixReuse, SemanticReuse

    served = _served(store, model, store_url)
    kwargs: dict[str, Any] = {} if threshold is None else {"threshold": threshold}
    semantic = SemanticReuse(store, served.model_id, embedder or MiniLMEmbedder(), mode="canonical", **kwargs)
    prefix = PrefixReuse(store, served.model_id, block_size=served.block_size)
    return PromptNormalizer(semantic, prefix.block_keys, served.block_size, store.contains)


def build_documents(
    store: KVStore, model: str, press: str | None = None, compression_ratio: float = 0.75, quant: str | None = None,
    max_model_len: int | None = None,
) -> Any:  # fmt: skip
    """The compressed-document matcher for ``model`` (the path vLLM serves) on ``store``: its tokenizer (read from
    the model folder, offline) and the fingerprint the connector announced."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from kvforge.route.documents import DocumentRouter
    from kvforge.vllm.client import DEFAULT_SLOT_MULTIPLE, VllmDocuments

    served = _served(store, model, "the store")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except OSError as e:
        raise UserError(f"cannot read the tokenizer of {model!r} here ({e})") from None
    blocks = served.kv_block_size or DEFAULT_SLOT_MULTIPLE  # documents fill whole blocks of vLLM's cache
    base = VllmDocuments(store, tokenizer, served.model_id, None, slot_multiple=blocks)
    folder = model if Path(model).is_dir() else None
    return DocumentRouter(base, press, compression_ratio, quant, max_model_len, folder)


def _served(store: KVStore, model: str, store_url: str) -> Any:
    """What the connector announced for ``model`` in ``store`` (its fingerprint and block size)."""
    from kvforge.vllm.identity import find_served

    served = find_served(store, model)
    if served is None:
        raise UserError(
            f"no vLLM server with kvforge's connector has announced {model!r} in {store_url}: start vLLM with "
            '--kv-transfer-config ... "kv_connector_extra_config": {"store": ...} on this same store'
        )
    return served


def create_router_app(*args: Any, **kwargs: Any) -> Any:
    """See :func:`kvforge.route.app.create_router_app` (imported on use: it needs the serve extra)."""
    from kvforge.route.app import create_router_app as create

    return create(*args, **kwargs)


__all__ = ["PromptNormalizer", "RouteDecision", "build_documents", "build_normalizer", "create_router_app"]
