"""``POST /v1/chat/completions`` and ``POST /v1/completions``: look the prompt up, rewrite it on a hit, forward it
(streamed or not) and report what was done; any other path is forwarded as it is."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvforge.route.documents import DocumentRoute
from kvforge.route.normalize import Endpoint, RouteDecision
from kvforge.route.routes.documents import answer_document
from kvforge.route.state import UPSTREAM_ERRORS, Router, error, get_router

logger = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/chat/completions")
async def chat(request: Request, state: Router = Depends(get_router)) -> Response:  # noqa: B008
    return await routed(state, request, "chat")


@router.post("/v1/completions")
async def completions(request: Request, state: Router = Depends(get_router)) -> Response:  # noqa: B008
    return await routed(state, request, "completions")


async def routed(state: Router, request: Request, endpoint: Endpoint) -> Response:
    try:
        body = json.loads(await request.body())
    except ValueError:
        return error(400, "the request body is not JSON", "invalid_json")
    if not isinstance(body, dict):
        return error(400, "the request body must be a JSON object", "invalid_json")
    document = DocumentRoute("skip", "no document matching on this router")
    if endpoint == "chat" and state.documents is not None:
        document = await _match_document(state, body)
        if document.kind == "hit":
            return await answer_document(state, request, body, document)
    try:
        decision = await asyncio.to_thread(state.normalizer.decide, endpoint, body)
    except Exception as e:  # a store or index fault: forward the request untouched rather than fail it
        logger.warning("route: lookup failed (%s); forwarding unchanged", e)
        decision = RouteDecision("skip", endpoint, reason=f"lookup failed: {type(e).__name__}")
    state.metrics.decisions.labels(decision.kind).inc()
    route_header = {"x-kvforge-route": decision.header()}
    if endpoint == "chat" and state.documents is not None:
        route_header["x-kvforge-document"] = document.header()
    return await _forward(state, request, decision, body, route_header, document)


async def _match_document(state: Router, body: dict[str, Any]) -> DocumentRoute:
    assert state.documents is not None
    try:
        return await asyncio.to_thread(state.documents.match, body)
    except Exception as e:  # a store fault: a full prefill rather than a failed request
        logger.warning("route: document lookup failed (%s); forwarding unchanged", e)
        return DocumentRoute("skip", f"lookup failed: {type(e).__name__}")


async def _forward(
    state: Router,
    request: Request,
    decision: RouteDecision,
    body: dict[str, Any],
    route_header: dict[str, str],
    document: DocumentRoute,
) -> Response:
    """The (rewritten) request sent upstream; its answer relayed with what the router did."""
    sent, headers = state.normalizer.rewrite(body, decision), state.headers(request)
    response = await state.send(request.url.path, sent, headers, request.query_params)
    if isinstance(response, Response):
        return response

    def maybe_record() -> None:
        if decision.kind == "miss" and response.status_code < 300:
            state.record_later(decision, sent, headers)

    if sent.get("stream"):  # decoded chunks: headers say nothing of gzip
        media = response.headers.get("content-type", "text/event-stream")
        return StreamingResponse(state.relay(response.aiter_bytes(), response, maybe_record),
                                 status_code=response.status_code, media_type=media, headers=route_header)  # fmt: skip
    data = await state.read(response)
    if isinstance(data, Response):  # e.g. a body cut short
        return data
    maybe_record()
    try:
        answer = json.loads(data)
    except ValueError:
        return Response(data, status_code=response.status_code, headers=route_header,
                        media_type=response.headers.get("content-type"))  # fmt: skip
    if isinstance(answer, dict) and response.status_code < 300:
        answer["kvforge"] = decision.report() | (document.report() if "x-kvforge-document" in route_header else {})
    return JSONResponse(answer, status_code=response.status_code, headers=route_header)


@router.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
async def passthrough(path: str, request: Request, state: Router = Depends(get_router)) -> Response:  # noqa: B008
    assert state.client is not None
    try:
        answer = await state.client.request(request.method, "/" + path, content=await request.body(),
                                            headers=state.headers(request), params=request.query_params)  # fmt: skip
    except UPSTREAM_ERRORS as e:
        return state.failed(e)
    return Response(answer.content, status_code=answer.status_code,
                    media_type=answer.headers.get("content-type"))  # fmt: skip
