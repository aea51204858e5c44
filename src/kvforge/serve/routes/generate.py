"""``POST /v1/completions`` and ``POST /v1/chat/completions``: translate, submit, answer (whole or streamed)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvforge.errors import Aborted, UserError
from kvforge.serve import schemas as S
from kvforge.serve.errors import APIError, timeout_error, user_error
from kvforge.serve.state import DONE, Server, get_server, shutting_down
from kvforge.serve.translate import Translated
from kvforge.types import Generation

logger = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/completions")
async def completions(request: HTTPRequest, server: Server = Depends(get_server)) -> Response:  # noqa: B008
    req = await server.parse(request, S.CompletionRequest)
    return await generate(server, request, req, req.prompt, True, "/v1/completions")


@router.post("/v1/chat/completions")
async def chat_completions(request: HTTPRequest, server: Server = Depends(get_server)) -> Response:  # noqa: B008
    req = await server.parse(request, S.ChatCompletionRequest)
    return await generate(server, request, req, req.chat(), False, "/v1/chat/completions")


async def generate(
    server: Server, request: HTTPRequest, req: S._GenerationRequest, prompt: Any, raw: bool, endpoint: str
) -> Response:
    translated: Translated = await server.off_loop(server.translator.generation, req, prompt, raw)
    rid = S.new_id("cmpl" if raw else "chatcmpl")
    if req.stream:
        return await stream(server, request, req, translated, rid, endpoint)
    job = server.submit(translated.request)
    job.endpoint = endpoint
    gen = await server.wait(request, job)
    if gen is None:
        return Response(status_code=499)
    model, engine = server.options.model_name, server.engine
    kvf = server.kvforge_field(gen, job, translated)
    usage = S.usage(gen.prompt_tokens, len(gen.token_ids), gen.reused_tokens)
    records = gen.info.get("logprobs")
    token_text = lambda t: engine.tokenizer.decode([t])  # noqa: E731
    if raw:
        text = (prompt if isinstance(prompt, str) and getattr(req, "echo", False) else "") + gen.text
        lp = S.completion_logprobs(records, token_text) if records is not None else None
        return JSONResponse(S.completion_body(rid, model, text, gen.finish_reason, usage, kvf, logprobs=lp))
    lp = S.chat_logprobs(records, token_text) if records is not None else None
    return JSONResponse(S.chat_body(rid, model, gen.text, gen.finish_reason, usage, kvf, logprobs=lp))


async def stream(
    server: Server, request: HTTPRequest, req: S._GenerationRequest, translated: Translated, rid: str, endpoint: str
) -> Response:
    raw, model = translated.request.raw, server.options.model_name
    deltas: asyncio.Queue[Any] = asyncio.Queue()
    job = server.submit(translated.request, deltas=deltas)  # a full queue is a 429 before the stream starts
    job.endpoint = endpoint
    if await server.wait(request, job, until_started=True) is not True:  # queueing happens before the 200 is sent
        return Response(status_code=499)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    timeout_s = server.options.request_timeout_s

    def chunk(delta: dict[str, Any] | None, text: str, finish: str | None) -> dict[str, Any]:
        if raw:
            return S.completion_body(rid, model, text, finish, None, None, chunk=True)
        return S.chat_chunk(rid, model, delta, finish)

    async def events() -> AsyncIterator[str]:
        try:
            if not raw:
                yield S.sse(chunk({"role": "assistant", "content": ""}, "", None))
            while True:
                remaining = job.deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(deltas.get(), timeout=max(remaining, 0.001))
                except asyncio.TimeoutError:
                    job.cancel("timeout")
                    server.metrics.aborted.labels("timeout").inc()
                    yield S.sse(timeout_error(timeout_s).body())
                    return
                if item is DONE:
                    break
                yield S.sse(chunk({"content": item}, item, None))
            try:
                gen: Generation = await asyncio.wait_for(asyncio.shield(job.future), timeout=30.0)
            except Aborted as e:
                server.metrics.aborted.labels(e.reason).inc()
                error = shutting_down() if e.reason == "shutdown" else timeout_error(timeout_s)
                yield S.sse(error.body())
                return
            except UserError as e:
                yield S.sse(user_error(e).body())
                return
            except Exception as e:  # already streaming: the error travels as an event
                logger.exception("generation failed")
                yield S.sse(APIError(500, f"internal error: {type(e).__name__}", type="server_error").body())
                return
            usage = S.usage(gen.prompt_tokens, len(gen.token_ids), gen.reused_tokens)
            last = chunk({}, "", gen.finish_reason)
            last["kvforge"] = server.kvforge_field(gen, job, translated)
            yield S.sse(last)
            if include_usage:
                final = S.completion_body(rid, model, "", None, usage, None) if raw else chunk(None, "", None)
                if raw:
                    final["choices"] = []
                final["usage"] = usage
                yield S.sse(final)
            yield "data: [DONE]\n\n"
        finally:
            if not job.future.done() and job.abort_reason is None:  # the client went away mid-stream
                job.cancel("cancelled")
                server.metrics.aborted.labels("cancelled").inc()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
