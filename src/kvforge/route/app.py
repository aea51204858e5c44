"""``kvforge route``: an OpenAI-compatible proxy in front of a vLLM server that normalises paraphrased prompts to
stored ones (:mod:`kvforge.route.normalize`), forwards every request, and reports what it did.

Chat and completion requests are looked up, rewritten on a hit and forwarded (streamed or not); the answer carries
a ``kvforge`` field (``route``: hit / exact / miss / skip, ``similarity``, ``donor_prompt``; non-streamed bodies)
and an ``X-KVForge-Route`` header (every answer). An answered miss is recorded in the background once the vLLM
connector has stored its blocks. Any other path is forwarded as it is. ``/health`` and ``/metrics`` are the router's.
The routes live in :mod:`kvforge.route.routes`, what they share in :mod:`kvforge.route.state`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI

from kvforge.route.documents import DocumentRouter
from kvforge.route.normalize import PromptNormalizer
from kvforge.route.routes import ROUTERS
from kvforge.route.state import Router
from kvforge.serve.middleware import GuardMiddleware


def create_router_app(
    normalizer: PromptNormalizer,
    upstream: str,
    *,
    upstream_api_key: str | None = None,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    max_body_bytes: int = 8 * 2**20,
    record_wait_s: float = 10.0,
    transport: httpx.AsyncBaseTransport | None = None,
    documents: DocumentRouter | None = None,
) -> Any:
    """The ASGI app. ``transport`` replaces the network in tests (an ``httpx.MockTransport``); ``documents``: serve
    chats on stored compressed documents and store them (``POST /v1/kv/documents``)."""
    router = Router(normalizer, upstream, upstream_api_key=upstream_api_key, api_key=api_key,
                    record_wait_s=record_wait_s, documents=documents)  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(timeout_s, connect=5.0)
        async with httpx.AsyncClient(base_url=upstream, timeout=timeout, transport=transport) as client:
            router.client = client
            yield
            for task in list(router.tasks):
                task.cancel()

    app = FastAPI(title="kvforge route", lifespan=lifespan)
    app.state.router = router
    for routes in ROUTERS:
        app.include_router(routes)
    return GuardMiddleware(app, router.metrics, api_key, max_body_bytes)  # type: ignore[arg-type]
