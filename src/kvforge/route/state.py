"""One router as its routes see it: the normaliser, the upstream client, the document matcher, the metrics, and
the few ways an upstream answer is sent, relayed or failed (a broken upstream is a 502, never a 500)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvforge.redact import redact_text, redact_url
from kvforge.route.documents import DocumentRouter
from kvforge.route.normalize import PromptNormalizer, RouteDecision
from kvforge.serve.errors import error_body

logger = logging.getLogger(__name__)

_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                "proxy-authorization", "accept-encoding"}  # fmt: skip
# whatever fails between the router and its upstream (refused, reset, cut-short body, stalled read): a 502, never a 500
UPSTREAM_ERRORS = (httpx.HTTPError, httpx.StreamError, OSError)


class RouteMetrics:
    """The router's own series (and those :class:`GuardMiddleware` counts)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvforge_route_http_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=r)  # fmt: skip
        self.errors = Counter("kvforge_route_http_errors", "Answers with an error", ["endpoint", "status"], registry=r)
        self.latency = Histogram("kvforge_route_latency_seconds", "Request latency", ["endpoint"], registry=r)
        self.decisions = Counter("kvforge_route_decisions", "Prompts seen, by what the router did", ["result"],
                                 registry=r)  # fmt: skip
        self.recorded = Counter("kvforge_route_recorded", "Missed prompts indexed once their KV was stored", registry=r)


def error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, "invalid_request_error", None, code), status_code=status)


class Router:
    """The state of one router app; ``client`` and ``tasks`` live while the app runs (its lifespan)."""

    def __init__(
        self,
        normalizer: PromptNormalizer,
        upstream: str,
        *,
        upstream_api_key: str | None,
        api_key: str | None,
        record_wait_s: float,
        documents: DocumentRouter | None,
    ) -> None:
        self.normalizer, self.upstream, self.documents = normalizer, upstream, documents
        self.upstream_api_key, self.api_key, self.record_wait_s = upstream_api_key, api_key, record_wait_s
        self.shown = redact_url(upstream)  # the upstream as every answer and log line names it: never its credentials
        self.metrics = RouteMetrics()
        self.client: httpx.AsyncClient | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------------------------------ upstream
    def headers(self, request: Request) -> dict[str, str]:
        """The client's headers as sent upstream: hop-by-hop ones dropped, the router's key swapped for the
        upstream's."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        headers.pop("authorization", None) if self.api_key is not None else None  # the router's key stays here
        if self.upstream_api_key is not None:
            headers["authorization"] = f"Bearer {self.upstream_api_key}"
        return headers

    async def send(self, path: str, body: dict[str, Any], headers: dict[str, str], params: Any = None) -> Any:
        """POST ``body`` upstream, its answer streamed (an ``httpx.Response``), or the 502 when it cannot be sent."""
        assert self.client is not None
        upstream_request = self.client.build_request("POST", path, json=body, headers=headers, params=params)
        try:
            return await self.client.send(upstream_request, stream=True)
        except UPSTREAM_ERRORS as e:
            return self.failed(e)

    async def read(self, response: httpx.Response) -> bytes | Response:
        """The whole body of a streamed answer, or the 502 when it is cut short."""
        try:
            return await response.aread()
        except UPSTREAM_ERRORS as e:
            return self.failed(e)
        finally:
            await response.aclose()

    async def relay(
        self, chunks: AsyncIterator[bytes], response: httpx.Response, at_end: Callable[[], None] | None = None
    ) -> AsyncIterator[bytes]:
        """``chunks`` of a streamed answer; an upstream that breaks or stalls mid-stream ends it with an error event."""
        try:
            async for chunk in chunks:
                yield chunk
            if at_end is not None:
                at_end()
        except UPSTREAM_ERRORS as e:  # broken or stalled mid-stream: the client is told, then [DONE]
            yield self.stream_failed(e)
        finally:
            await response.aclose()

    def failed(self, e: BaseException) -> JSONResponse:
        return error(502, f"upstream {self.shown} unreachable or failed: {type(e).__name__}", "upstream_unavailable")

    def stream_failed(self, e: BaseException) -> bytes:
        """The end of a stream whose upstream broke or stalled: an error event, then ``[DONE]``."""
        logger.warning("route: upstream stream from %s failed (%s)", self.shown, type(e).__name__)
        body = error_body(f"upstream {self.shown} failed mid-stream: {type(e).__name__}", "server_error", None,
                          "upstream_unavailable")  # fmt: skip
        return f"\n\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()

    # ------------------------------------------------------------------------------------------ record
    def record_later(self, decision: RouteDecision, body: dict[str, Any], headers: dict[str, str]) -> None:
        """Index an answered miss in the background (the task is cancelled when the app stops)."""
        task = asyncio.get_running_loop().create_task(self._record(decision, body, headers))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _record(self, decision: RouteDecision, body: dict[str, Any], headers: dict[str, str]) -> None:
        """Tokenize the prompt as the upstream did, then index it once its blocks are stored."""
        assert self.client is not None
        try:
            tok = await self.client.post("/tokenize", json=self.normalizer.tokenize_body(body, decision),
                                         headers=headers)  # fmt: skip
            tok.raise_for_status()
            ids = [int(t) for t in tok.json()["tokens"]]
            outcome = await asyncio.to_thread(self.normalizer.record, decision, ids, self.record_wait_s)
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
            outcome = f"not recorded: upstream /tokenize failed ({redact_text(str(e))})"
        except Exception as e:  # a store fault while recording: this prompt is simply not indexed
            outcome = f"not recorded: {type(e).__name__}: {redact_text(str(e))}"
        if outcome == "recorded":
            self.metrics.recorded.inc()
        logger.info("route: prompt %s", outcome)


def get_router(request: Request) -> Router:
    """The app's :class:`Router` (a FastAPI dependency)."""
    return request.app.state.router  # type: ignore[no-any-return]
