"""What a server builds on demand: presses by name, the one KV store, reuse strategies over it.

A request that asks for an unknown name, or for a strategy whose optional dependency is missing (semantic reuse
without faiss), gets a 400 (never a 500); a store that cannot be reached makes requests run without reuse.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvforge.engine import Engine
from kvforge.errors import StoreUnavailableError, UserError
from kvforge.names import PRESS_OPTION_SEP
from kvforge.presses import build_press
from kvforge.presses.base import Press
from kvforge.reuse import REUSE, build_reuse
from kvforge.reuse.base import ReuseStrategy
from kvforge.reuse.rag import ChunkReuse
from kvforge.serve.errors import APIError
from kvforge.store import open_store
from kvforge.store.base import KVStore

STORE_RETRY_S = 10  # a store found unreachable is not tried again for this long (no per-request connect wait)

logger = logging.getLogger(__name__)


def _bad(e: Exception, param: str) -> APIError:
    return APIError(400, str(e), param=param, code="invalid_value")


class Features:
    """Builds and caches the components of one server (one store shared by every reuse strategy).

    Args:
        engine: the served engine (its model id keys the store).
        store_url: ``kvforge.store.open_store`` URL; None = an in-memory store, opened when reuse first needs it.
        embedder: the semantic strategies' embedder (None = the reuse package's MiniLM one).
        semantic: options of the semantic strategies (``threshold``, ``max_error``, ``verify_ratio``).
    """

    def __init__(
        self, engine: Engine, store_url: str | None = None, embedder: Any = None, semantic: dict[str, Any] | None = None
    ) -> None:
        self.engine = engine
        self.semantic = {k: v for k, v in (semantic or {}).items() if v is not None}
        self.store_url = store_url
        self.embedder = embedder
        self._store: KVStore | None = None
        self._strategies: dict[tuple[str, str], ReuseStrategy] = {}
        self._lock = threading.Lock()
        self._store_retry_at = 0.0

    def press(
        self, name: str | None, compression_ratio: float, param: str = "kvforge.press", client: bool = True
    ) -> Press | None:
        """The press ``name`` at ``compression_ratio`` (None when no press is asked for). A client names a press
        only: options (``kvzip:pool=3``, some of which name files or set the work done) are the operator's."""
        if name is None or name == "none":
            return None
        if client and PRESS_OPTION_SEP in name:
            raise APIError(400, f"{param} takes a press name; press options are set by the server's --press",
                           param=param, code="invalid_value")  # fmt: skip
        try:
            return build_press(name, compression_ratio=compression_ratio)
        except (UserError, ValueError, TypeError) as e:
            raise _bad(e, param) from e

    @property
    def store(self) -> KVStore:
        with self._lock:
            if self._store is None:
                if time.monotonic() < self._store_retry_at:
                    raise StoreUnavailableError(f"store unavailable (retried after {STORE_RETRY_S}s)")
                try:
                    self._store = open_store(self.store_url or "memory://")
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

    def reuse(self, kind: str | None, semantic_mode: str | None = None, strict: bool = False) -> ReuseStrategy | None:
        """The strategy for ``kind`` ("prefix" | "semantic" | "document"; "none"/None -> None), built once per kind.

        A store that cannot be reached makes this None (the request runs without reuse) unless ``strict`` (server
        start, storing documents), where it raises :class:`StoreUnavailableError`.
        """
        if kind is None or kind == "none":
            return None
        mode = semantic_mode or "canonical"
        key = (kind, mode if kind == "semantic" else "")
        if key in self._strategies:
            return self._strategies[key]
        if kind not in REUSE or kind == "rag":
            choices = ", ".join(k for k in REUSE if k != "rag")
            raise APIError(400, f"unknown reuse strategy {kind!r}; choose from: none, {choices}",
                           param="kvforge.reuse", code="invalid_value")  # fmt: skip
        try:
            store = self.store
        except StoreUnavailableError:
            if strict:
                raise
            return None  # a store that cannot be reached is a miss: the request is answered without reuse
        engine = self.engine
        try:
            options = self.semantic if kind == "semantic" else {}
            strategy = build_reuse(kind, store, engine.model_id, semantic_mode=mode, embedder=self.embedder,
                                   device=getattr(engine.model, "device", None), **options)  # fmt: skip
        except ImportError as e:  # an optional dependency of the strategy (faiss, sentence-transformers)
            raise APIError(400, f"{kind} reuse is not available on this server ({e})", param="kvforge.reuse",
                           code="feature_unavailable") from e  # fmt: skip
        except (UserError, ValueError, TypeError) as e:
            raise _bad(e, "kvforge.reuse") from e
        self._strategies[key] = strategy
        return strategy

    def chunk_reuse(self, method: str = "naive", recompute_ratio: float | None = None) -> ChunkReuse:
        """A RAG chunk reuse strategy over the server's store."""
        engine = self.engine
        try:
            return ChunkReuse(engine.model, engine.tokenizer, store=self.store, model_id=engine.model_id,
                              method=method, recompute_ratio=recompute_ratio)  # fmt: skip
        except (UserError, ValueError, TypeError) as e:
            raise _bad(e, "kvforge.rag") from e

    def chunk_texts(self, strategy: ChunkReuse, chunk_ids: list[str]) -> list[str]:
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
