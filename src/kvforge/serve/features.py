"""Optional kvforge features behind the server: presses, the KV store, reuse strategies, document precompute.

Each feature's module is imported when first used, so the server runs on an installation without it; a request that
asks for a missing feature or an unknown name gets a 400 (never a 500).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import threading
import time
from typing import Any

from kvforge.errors import StoreUnavailableError, UserError
from kvforge.serve.errors import APIError

STORE_RETRY_S = 10  # a store found unreachable is not tried again for this long (no per-request connect wait)

logger = logging.getLogger(__name__)


def _import(module: str, feature: str, param: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise APIError(
            400, f"{feature} is not available on this server ({module}: {e})", param=param, code="feature_unavailable"
        ) from e


def _bad(e: Exception, param: str) -> APIError:
    return APIError(400, str(e), param=param, code="invalid_value")


class Features:
    """Builds and caches the optional components of one server (one store shared by every reuse strategy).

    Args:
        engine: the :class:`~kvforge.engine.Engine` (its model id keys the store).
        store_url: ``kvforge.store.open_store`` URL; None = an in-memory store, opened when reuse first needs it.
        embedder: the semantic strategies' embedder (None = the reuse package's MiniLM one).
        semantic: options of the semantic strategies (``threshold``, ``max_error``, ``verify_ratio``).
    """

    def __init__(self, engine: Any, store_url: str | None = None, embedder: Any = None,
                 semantic: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.semantic = {k: v for k, v in (semantic or {}).items() if v is not None}
        self.store_url = store_url
        self.embedder = embedder
        self._store: Any = None
        self._strategies: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        self._store_retry_at = 0.0

    # ------------------------------------------------------------------------------------------ press
    def press(self, name: str | None, compression_ratio: float) -> Any:
        """The press ``name`` at ``compression_ratio`` (None when no press is asked for)."""
        if name is None or name == "none":
            return None
        presses = _import("kvforge.presses", "KV compression (presses)", "kvforge.press")
        try:
            return presses.build_press(name, compression_ratio=compression_ratio)
        except (UserError, ValueError, TypeError) as e:
            raise _bad(e, "kvforge.press") from e

    # ------------------------------------------------------------------------------------------ store
    @property
    def store(self) -> Any:
        with self._lock:
            if self._store is None:
                store_mod = _import("kvforge.store", "the KV store", "kvforge.reuse")
                if time.monotonic() < self._store_retry_at:
                    raise StoreUnavailableError(f"store unavailable (retried after {STORE_RETRY_S}s)")
                try:
                    self._store = store_mod.open_store(self.store_url or "memory://")
                except StoreUnavailableError as e:
                    self._store_retry_at = time.monotonic() + STORE_RETRY_S
                    logger.warning("%s; requests run without KV reuse, retrying in %ds", e, STORE_RETRY_S)
                    raise  # its message names the URL redacted; API clients get only "store unavailable" (errors.py)
                except (UserError, ValueError) as e:
                    raise _bad(e, "store") from e
            return self._store

    @property
    def has_store(self) -> bool:
        return self._store is not None

    def store_stats(self) -> dict[str, Any] | None:
        return self._store.stats() if self._store is not None else None

    # ------------------------------------------------------------------------------------------ reuse
    def reuse(self, kind: str | None, semantic_mode: str | None = None, strict: bool = False) -> Any:
        """The strategy for ``kind`` ("prefix" | "semantic"; "none"/None -> None), built once per (kind, mode).

        A store that cannot be reached makes this None (the request runs without reuse) unless ``strict`` (server
        start, storing documents), where it raises :class:`StoreUnavailableError`.
        """
        if kind is None or kind == "none":
            return None
        mode = semantic_mode or "canonical"
        key = (kind, mode if kind == "semantic" else "")
        if key in self._strategies:
            return self._strategies[key]
        reuse_mod = _import("kvforge.reuse", "KV reuse", "kvforge.reuse")
        registry = getattr(reuse_mod, "REUSE", {})
        if kind not in registry:
            raise APIError(
                400,
                f"unknown reuse strategy {kind!r}; choose from: none, {', '.join(sorted(registry))}",
                param="kvforge.reuse",
                code="invalid_value",
            )
        try:
            store = self.store
        except StoreUnavailableError:
            if strict:
                raise
            return None  # a store that cannot be reached is a miss: the request is answered without reuse
        device = getattr(self.engine.model, "device", None)
        try:
            if hasattr(reuse_mod, "build_reuse"):
                extra = {"model": self.engine.model, "tokenizer": self.engine.tokenizer, **self.semantic}
                strategy = reuse_mod.build_reuse(
                    kind, store, self.engine.model_id, semantic_mode=mode, embedder=self.embedder, device=device,
                    **(extra if kind == "semantic" else {}),
                )  # fmt: skip
            elif kind == "semantic":
                embedder = self.embedder if self.embedder is not None else reuse_mod.EMBEDDERS["minilm"]()
                strategy = registry[kind](store, self.engine.model_id, embedder, mode=mode, device=device)
            else:
                strategy = registry[kind](store, self.engine.model_id, device=device)
        except (UserError, ValueError, TypeError) as e:
            raise _bad(e, "kvforge.reuse") from e
        self._strategies[key] = strategy
        return strategy

    # ------------------------------------------------------------------------------------------ documents
    def precompute_documents(
        self,
        documents: list[str],
        mode: str,
        system: str | None,
        strategy: Any,
        press: Any = None,
        quant: str | None = None,
    ) -> list[dict[str, Any]]:
        """Compute and store the KV of each document; returns one ``{"id", "tokens", ...}`` per document.

        ``prefix`` mode stores the document as the context part of a chat prompt (system + user header + document +
        separator, :meth:`Engine.encode_qa`) through ``strategy`` (a prefix reuse strategy), so a later chat request
        whose user message is ``document + "\\n\\n" + question`` reuses it. ``chunks`` mode stores each document
        as a RAG chunk (``kvforge.reuse.rag``), keyed by its chunk key (the id a chat request names it by in
        ``kvforge.chunk_ids``; the chunk's text is stored with its KV). Runs on the worker thread.

        With a ``press``, a prefix document is compressed query-agnostic and stored whole, keyed by the press, its
        parameters and ``quant`` (None: the store's): a chat request naming the same press with
        ``query_aware=false`` and prefix reuse loads it and prefills only its question.
        """
        if mode == "chunks":
            return self._precompute_chunks(documents, system)
        if strategy is None:
            raise APIError(
                400,
                "prefix documents need a reuse strategy: start the server with --reuse prefix or send kvforge.reuse",
                param="mode",
                code="feature_unavailable",
            )
        out = []
        for doc in documents:
            ctx_ids, _ = self.engine.encode_qa(doc, "?", system=system)
            self.engine.check_length(len(ctx_ids))
            cache, _ = self.engine.prefill(ctx_ids, press=press)
            entry = {"object": "kv.document", "mode": "prefix", "tokens": len(ctx_ids)}
            if press is None:
                strategy.record(ctx_ids, cache, text=doc)
                digest = hashlib.sha256(repr((self.engine.model_id, ctx_ids)).encode()).hexdigest()[:32]
                out.append({"id": f"kvdoc-{digest}", **entry})
                continue
            from kvforge.reuse.base import PromptContext
            from kvforge.reuse.document import press_spec

            if not getattr(strategy, "stores_compressed", False):
                raise APIError(400, f"{type(strategy).__name__} does not store compressed documents", param="press")
            context = PromptContext(doc, len(ctx_ids), press=press, quant=quant)
            strategy.record(ctx_ids, cache, text=doc, context=context)
            key = strategy.documents.key(ctx_ids, context)
            size = getattr(strategy.store, "stored_size", None)
            out.append(
                {
                    "id": key,
                    **entry,
                    "press": press_spec(press),
                    "compression_ratio": press.ratio(),
                    "quant": strategy.documents.quant_of(context),
                    "kept_entries": cache.num_entries(),
                    "stored_bytes": size(key) if size is not None else None,
                }
            )
        return out

    def chunk_reuse(self, method: str = "naive", recompute_ratio: float | None = None) -> Any:
        """A RAG chunk reuse strategy over the server's store (``kvforge.reuse.rag.ChunkReuse``)."""
        reuse_rag = _import("kvforge.reuse.rag", "RAG chunk reuse", "kvforge.rag")
        try:
            return reuse_rag.ChunkReuse(
                self.engine.model,
                self.engine.tokenizer,
                store=self.store,
                model_id=self.engine.model_id,
                method=method,
                recompute_ratio=recompute_ratio,
            )
        except (UserError, ValueError, TypeError) as e:
            raise _bad(e, "kvforge.rag") from e

    def chunk_texts(self, strategy: Any, chunk_ids: list[str]) -> list[str]:
        """The texts of chunks stored through ``POST /v1/kv/documents`` (``mode: chunks``), by their ids."""
        texts = []
        for i, key in enumerate(chunk_ids):
            try:
                texts.append(strategy.chunks.text_of(key))
            except KeyError:
                raise APIError(
                    400,
                    f"unknown chunk id {key[:64]!r}: store the chunk through /v1/kv/documents (mode chunks)",
                    param=f"kvforge.chunk_ids[{i}]",
                    code="invalid_value",
                ) from None
        return texts

    def _precompute_chunks(self, documents: list[str], system: str | None) -> list[dict[str, Any]]:
        strategy = self.chunk_reuse()
        try:
            prompt = strategy.build_prompt(documents, "?", system=system)
        except ValueError as e:
            raise _bad(e, "documents") from e
        self.engine.check_length(len(prompt.ids()))
        strategy.warm(prompt)
        from kvforge.rag import chunk_key

        return [
            {
                "id": chunk_key(strategy.model_id, prompt.prefix_ids, chunk),
                "object": "kv.document",
                "mode": "chunks",
                "tokens": len(chunk),
            }
            for chunk in prompt.chunk_ids
        ]
