"""``create_app(engine)``: the OpenAI-compatible FastAPI app around one :class:`~kvforge.engine.Engine`.

The routes (:mod:`kvforge.serve.routes`) translate OpenAI bodies into engine requests (:mod:`kvforge.serve.translate`,
tokenised off the model thread); one thread owns the model (:mod:`kvforge.serve.scheduler`: queueing, admission and
deadlines around ``engine.step()``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from kvforge.engine import Engine
from kvforge.errors import UserError
from kvforge.reuse.base import ReuseStrategy
from kvforge.serve.errors import APIError, install_handlers
from kvforge.serve.features import Features
from kvforge.serve.metrics import Metrics
from kvforge.serve.middleware import GuardMiddleware, check_api_key
from kvforge.serve.routes import ROUTERS
from kvforge.serve.scheduler import Scheduler
from kvforge.serve.state import Server
from kvforge.serve.translate import ServerOptions

logger = logging.getLogger(__name__)

SCHEDULERS = ("batched", "serial")


def create_app(
    engine: Engine,
    *,
    model_name: str = "kvforge",
    store_url: str | None = None,
    reuse: str | ReuseStrategy | None = None,
    semantic_mode: str = "canonical",
    semantic: dict[str, Any] | None = None,
    press: str | None = None,
    compression_ratio: float = 0.5,
    max_queue: int = 16,
    request_timeout_s: float = 300.0,
    api_key: str | None = None,
    max_body_bytes: int = 8 * 2**20,
    default_max_tokens: int = 256,
    embedder: Any = None,
    scheduler: str = "batched",
    max_running: int = 16,
    prefill_budget: int = 128,
) -> FastAPI:
    """The server app.

    Args:
        engine: the model to serve; its ``reuse`` strategy is set from ``reuse``, its ``prefill_budget`` from
            ``prefill_budget``.
        model_name: the id clients send as ``model`` (and ``/v1/models`` lists).
        store_url: where reuse keeps KV (``kvforge.store.open_store`` URL; None = in memory).
        reuse: default reuse: "prefix" | "semantic" | "document" | "none"/None, or a strategy object.
        semantic: semantic reuse's policy options (``threshold``, ``max_error``, ``verify_ratio``; None = defaults).
        press, compression_ratio: default compression (requests may override both in their ``kvforge`` field).
        max_queue: requests waiting for a place in the engine before 429s start.
        request_timeout_s: queueing + generation time allowed (504 after it).
        api_key: Bearer key required on ``/v1/*`` when set.
        max_body_bytes: request bodies above it get a 413.
        default_max_tokens: chat completions without ``max_tokens`` (capped at what the context has left).
        embedder: semantic reuse's embedder (None = MiniLM).
        scheduler: "batched" (up to ``max_running`` requests in the engine at once: decoded together, prompts
            prefilled beside them ``prefill_budget`` tokens per step, a lone prompt in the engine's chunks) or
            "serial" (one request at a time).
    """
    if not 0 <= compression_ratio < 1:
        raise UserError(f"compression ratio must be in [0, 1), got {compression_ratio}")
    if scheduler not in SCHEDULERS:
        raise UserError(f"unknown scheduler {scheduler!r}; choose from: {', '.join(SCHEDULERS)}")
    if prefill_budget < 1:
        raise UserError(f"prefill budget must be >= 1, got {prefill_budget}")
    check_api_key(api_key)  # now, not at the first request (the middleware is built then)
    features = Features(engine, store_url=store_url, embedder=embedder, semantic=semantic)
    reuse_kind = reuse if isinstance(reuse, str) else ("custom" if reuse is not None else "none")
    try:  # fail at startup on an unknown default press or reuse strategy
        features.press(press, compression_ratio, client=False)  # the operator's --press may carry options
        engine.reuse = features.reuse(reuse, semantic_mode, strict=True) if isinstance(reuse, str) else reuse
    except APIError as e:
        raise UserError(e.message) from e
    engine.prefill_budget = prefill_budget
    model_thread = Scheduler(engine, max_queue, max_running if scheduler == "batched" else 1)
    stats = CachedStats(features.store_stats)
    metrics = Metrics(lambda: model_thread.depth, stats.get, model_name=model_name,
                      num_running=lambda: model_thread.num_running, profile=model_thread.profile)  # fmt: skip
    stats.get()  # first fetch in the background now, so the first scrape has figures
    options = ServerOptions(model_name, reuse_kind, semantic_mode, press, compression_ratio, default_max_tokens,
                            request_timeout_s)  # fmt: skip
    server = Server(engine, options, features, model_thread, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        server.close()

    app = FastAPI(title="kvforge", version="0.1.0", lifespan=lifespan)
    app.state.server = server
    app.state.drain = model_thread.drain  # SIGTERM (commands/serve.py): stop taking work, finish the running ones
    app.state.engine, app.state.worker, app.state.metrics, app.state.features = engine, model_thread, metrics, features
    app.add_middleware(GuardMiddleware, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes)
    install_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


class CachedStats:
    """The store's stats as last fetched, refreshed in a background thread: ``/metrics`` never waits on a store.

    ``get`` returns at once (None until the first fetch ends) and starts a refresh when the value is older than
    ``max_age_s`` and none is running; a store that fails or hangs leaves the last value in place.
    """

    def __init__(self, fetch: Callable[[], Any], max_age_s: float = 5.0) -> None:
        self.fetch, self.max_age_s = fetch, max_age_s
        self.value: Any = None
        self.fetched_at = float("-inf")
        self._running = threading.Lock()

    def get(self) -> Any:
        if time.monotonic() - self.fetched_at > self.max_age_s and self._running.acquire(blocking=False):
            threading.Thread(target=self._refresh, name="kvforge-store-stats", daemon=True).start()
        return self.value

    def _refresh(self) -> None:
        try:
            self.value = self.fetch()
        except Exception as e:  # a store that cannot answer keeps the last figures
            logger.warning("store stats unavailable: %s", type(e).__name__)
        finally:
            self.fetched_at = time.monotonic()
            self._running.release()
