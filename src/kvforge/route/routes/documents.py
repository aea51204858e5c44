"""``POST /v1/kv/documents`` (compress and store documents for vLLM) and the answer to a chat whose document is
stored: asked of vLLM as a completion on the document's slots, turned back into a chat answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvforge.errors import UserError
from kvforge.route.documents import DocumentRoute, chat_answer, chat_stream, loaded
from kvforge.route.state import UPSTREAM_ERRORS, Router, error, get_router

router = APIRouter()


@router.post("/v1/kv/documents")
async def store_documents(request: Request, state: Router = Depends(get_router)) -> Response:  # noqa: B008
    if state.documents is None:
        return error(404, "this router stores no documents", "not_found")
    try:
        body = json.loads(await request.body())
        data = await asyncio.to_thread(state.documents.store, body)
    except ValueError as e:  # not JSON, or a body DocumentsRequest refuses (pydantic's error is a ValueError)
        return error(400, f"invalid documents request: {str(e)[:500]}", "invalid_request")
    except UserError as e:
        return error(400, str(e), "invalid_request")
    return JSONResponse({"object": "list", "data": data})


async def answer_document(state: Router, request: Request, body: dict[str, Any], document: DocumentRoute) -> Response:
    """A chat on a stored compressed document, asked of vLLM as a completion on the document's slots."""
    sent, headers = document.completion or {}, state.headers(request)
    head = {"x-kvforge-document": document.header()}
    response = await state.send("/v1/completions", sent, headers)
    if isinstance(response, Response):
        return response
    if sent.get("stream") and response.status_code < 300:
        return StreamingResponse(state.relay(chat_stream(response.aiter_lines()), response),
                                 media_type="text/event-stream", headers=head)  # fmt: skip
    data = await state.read(response)
    if isinstance(data, Response):  # a body cut short
        return data
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if response.status_code >= 300 or not isinstance(answer, dict):
        return JSONResponse(answer, status_code=response.status_code, headers=head)
    if not loaded(answer):  # the connector could not load the document: the full chat, never a wrong answer
        return await _full_chat(state, body, headers, document)
    out = chat_answer(answer)
    out["kvforge"] = document.report()
    return JSONResponse(out, headers=head)


async def _full_chat(state: Router, body: dict[str, Any], headers: dict[str, str], document: DocumentRoute) -> Response:
    """The chat asked again in full, when the document's KV could not be loaded."""
    assert state.client is not None
    fallback = DocumentRoute("fallback", "the document's KV could not be loaded", document.doc)
    try:
        full: httpx.Response = await state.client.post(
            "/v1/chat/completions", json={k: v for k, v in body.items() if k != "kvforge"}, headers=headers
        )
        answer = full.json()
    except (*UPSTREAM_ERRORS, ValueError) as e:
        return state.failed(e)
    if isinstance(answer, dict) and full.status_code < 300:
        answer["kvforge"] = fallback.report()
    return JSONResponse(answer, status_code=full.status_code, headers={"x-kvforge-document": "fallback"})
