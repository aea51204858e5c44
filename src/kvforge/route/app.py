"""``kvforge route``: an OpenAI-compatible proxy in front of a vLLM server that normalises paraphrased prompts to
stored ones (:mod:`kvforge.route.normalize`), forwards every request, and reports what it did.

Chat and completion requests are looked up, rewritten on a hit and forwarded (streamed or not); the answer carries
a ``kvforge`` field (``route``: hit / exact / miss / skip, ``similarity``, ``donor_prompt``; non-streamed bodies)
and an ``X-KVForge-Route`` header (every answer). An answered miss is recorded in the background once the vLLM
connector has stored its blocks. Any other path is forwarded as it is. ``/health`` and ``/metrics`` are the router's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvforge.errors import UserError
from kvforge.redact import redact_text, redact_url
from kvforge.route.documents import DocumentRoute, DocumentRouter, chat_answer, chat_stream, loaded
from kvforge.route.normalize import Endpoint, PromptNormalizer, RouteDecision
from kvforge.serve.errors import error_body
from kvforge.serve.middleware import GuardMiddleware

logger = logging.getLogger(__name__)

_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                "proxy-authorization", "accept-encoding"}  # fmt: skip
_ROUTED = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# whatever fails between the router and its upstream (refused, reset, cut-short body, stalled read): a 502, never a 500
_UPSTREAM_ERRORS = (httpx.HTTPError, httpx.StreamError, OSError)


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


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, "invalid_request_error", None, code), status_code=status)


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
    metrics = RouteMetrics()
    state: dict[str, Any] = {}
    shown = redact_url(upstream)  # the upstream as every answer and log line names it: never its credentials

    def stream_failed(e: BaseException) -> bytes:
        """The end of a stream whose upstream broke or stalled: an error event, then ``[DONE]``."""
        logger.warning("route: upstream stream from %s failed (%s)", shown, type(e).__name__)
        body = error_body(f"upstream {shown} failed mid-stream: {type(e).__name__}", "server_error", None,
                          "upstream_unavailable")  # fmt: skip
        return f"\n\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()

    def upstream_failed(e: BaseException) -> JSONResponse:
        return _error(502, f"upstream {shown} unreachable or failed: {type(e).__name__}", "upstream_unavailable")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(timeout_s, connect=5.0)
        async with httpx.AsyncClient(base_url=upstream, timeout=timeout, transport=transport) as client:
            state["client"] = client
            state["tasks"] = set()
            yield
            for task in list(state["tasks"]):
                task.cancel()

    app = FastAPI(title="kvforge route", lifespan=lifespan)

    def upstream_headers(request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        headers.pop("authorization", None) if api_key is not None else None  # the router's key stays here
        if upstream_api_key is not None:
            headers["authorization"] = f"Bearer {upstream_api_key}"
        return headers

    async def record_later(decision: RouteDecision, body: dict[str, Any], headers: dict[str, str]) -> None:
        """Tokenize the prompt as the upstream did, then index it once its blocks are stored."""
        try:
            tok = await state["client"].post(
                "/tokenize", json=normalizer.tokenize_body(body, decision), headers=headers
            )
            tok.raise_for_status()
            ids = [int(t) for t in tok.json()["tokens"]]
            outcome = await asyncio.to_thread(normalizer.record, decision, ids, record_wait_s)
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
            outcome = f"not recorded: upstream /tokenize failed ({redact_text(str(e))})"
        except Exception as e:  # a store fault while recording: this prompt is simply not indexed
            outcome = f"not recorded: {type(e).__name__}: {redact_text(str(e))}"
        if outcome == "recorded":
            metrics.recorded.inc()
        logger.info("route: prompt %s", outcome)

    async def routed(request: Request, endpoint: Endpoint) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "the request body is not JSON", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_json")
        document = DocumentRoute("skip", "no document matching on this router")
        if endpoint == "chat" and documents is not None:
            try:
                document = await asyncio.to_thread(documents.match, body)
            except Exception as e:  # a store fault: a full prefill rather than a failed request
                logger.warning("route: document lookup failed (%s); forwarding unchanged", e)
                document = DocumentRoute("skip", f"lookup failed: {type(e).__name__}")
            if document.kind == "hit":
                return await answer_document(request, body, document)
        try:
            decision = await asyncio.to_thread(normalizer.decide, endpoint, body)
        except Exception as e:  # a store or index fault: forward the request untouched rather than fail it
            logger.warning("route: lookup failed (%s); forwarding unchanged", e)
            decision = RouteDecision("skip", endpoint, reason=f"lookup failed: {type(e).__name__}")
        metrics.decisions.labels(decision.kind).inc()
        sent = normalizer.rewrite(body, decision)
        headers = upstream_headers(request)
        route_header = {"x-kvforge-route": decision.header()}
        if endpoint == "chat" and documents is not None:
            route_header["x-kvforge-document"] = document.header()
        client: httpx.AsyncClient = state["client"]
        upstream_request = client.build_request("POST", request.url.path, json=sent, headers=headers,
                                                params=request.query_params)  # fmt: skip
        try:
            response = await client.send(upstream_request, stream=True)
        except _UPSTREAM_ERRORS as e:
            return upstream_failed(e)

        def maybe_record() -> None:
            if decision.kind == "miss" and response.status_code < 300:
                task = asyncio.get_running_loop().create_task(record_later(decision, sent, headers))
                state["tasks"].add(task)
                task.add_done_callback(state["tasks"].discard)

        if sent.get("stream"):

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in response.aiter_bytes():  # decoded: headers say nothing of gzip
                        yield chunk
                    maybe_record()
                except _UPSTREAM_ERRORS as e:  # broken or stalled mid-stream: the client is told, then [DONE]
                    yield stream_failed(e)
                finally:
                    await response.aclose()

            media = response.headers.get("content-type", "text/event-stream")
            return StreamingResponse(relay(), status_code=response.status_code, media_type=media, headers=route_header)
        try:
            data = await response.aread()
        except _UPSTREAM_ERRORS as e:  # e.g. a body cut short
            return upstream_failed(e)
        finally:
            await response.aclose()
        maybe_record()
        try:
            answer = json.loads(data)
        except ValueError:
            return Response(data, status_code=response.status_code, headers=route_header,
                            media_type=response.headers.get("content-type"))  # fmt: skip
        if isinstance(answer, dict) and response.status_code < 300:
            answer["kvforge"] = decision.report() | (document.report() if "x-kvforge-document" in route_header else {})
        return JSONResponse(answer, status_code=response.status_code, headers=route_header)

    async def answer_document(request: Request, body: dict[str, Any], document: DocumentRoute) -> Response:
        """A chat on a stored compressed document, asked of vLLM as a completion on the document's slots."""
        client: httpx.AsyncClient = state["client"]
        sent, headers = document.completion or {}, upstream_headers(request)
        head = {"x-kvforge-document": document.header()}
        try:
            response = await client.send(client.build_request("POST", "/v1/completions", json=sent, headers=headers),
                                         stream=True)  # fmt: skip
        except _UPSTREAM_ERRORS as e:
            return upstream_failed(e)
        if sent.get("stream") and response.status_code < 300:

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in chat_stream(response.aiter_lines()):
                        yield chunk
                except _UPSTREAM_ERRORS as e:
                    yield stream_failed(e)
                finally:
                    await response.aclose()

            return StreamingResponse(relay(), media_type="text/event-stream", headers=head)
        try:
            answer = json.loads(await response.aread())
        except ValueError:
            answer = None
        except _UPSTREAM_ERRORS as e:  # a body cut short
            return upstream_failed(e)
        finally:
            await response.aclose()
        if response.status_code >= 300 or not isinstance(answer, dict):
            return JSONResponse(answer, status_code=response.status_code, headers=head)
        if not loaded(answer):  # the connector could not load the document: the full chat, never a wrong answer
            fallback = DocumentRoute("fallback", "the document's KV could not be loaded", document.doc)
            try:
                full = await client.post("/v1/chat/completions", json={k: v for k, v in body.items() if k != "kvforge"},
                                         headers=headers)  # fmt: skip
                answer = full.json()
            except (*_UPSTREAM_ERRORS, ValueError) as e:
                return upstream_failed(e)
            if isinstance(answer, dict) and full.status_code < 300:
                answer["kvforge"] = fallback.report()
            return JSONResponse(answer, status_code=full.status_code, headers={"x-kvforge-document": "fallback"})
        out = chat_answer(answer)
        out["kvforge"] = document.report()
        return JSONResponse(out, headers=head)

    @app.post("/v1/kv/documents")
    async def store_documents(request: Request) -> Response:
        if documents is None:
            return _error(404, "this router stores no documents", "not_found")
        try:
            body = json.loads(await request.body())
            data = await asyncio.to_thread(documents.store, body)
        except ValueError as e:  # not JSON, or a body DocumentsRequest refuses (pydantic's error is a ValueError)
            return _error(400, f"invalid documents request: {str(e)[:500]}", "invalid_request")
        except UserError as e:
            return _error(400, str(e), "invalid_request")
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await routed(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await routed(request, "completions")

    @app.get("/health")
    async def health() -> Response:
        try:
            answer = await state["client"].get("/health", timeout=5.0)
            ok = answer.status_code == 200
        except _UPSTREAM_ERRORS:
            ok = False
        body = {"status": "ok" if ok else "upstream unavailable", "upstream": shown}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def passthrough(path: str, request: Request) -> Response:
        client: httpx.AsyncClient = state["client"]
        try:
            answer = await client.request(request.method, "/" + path, content=await request.body(),
                                          headers=upstream_headers(request), params=request.query_params)  # fmt: skip
        except _UPSTREAM_ERRORS as e:
            return upstream_failed(e)
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type"))  # fmt: skip

    return GuardMiddleware(app, metrics, api_key, max_body_bytes)  # type: ignore[arg-type]
