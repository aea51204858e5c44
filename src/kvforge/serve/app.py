"""``create_app(engine)``: the OpenAI-compatible FastAPI app around one :class:`~kvforge.engine.Engine`.

Routes only translate OpenAI schemas into :class:`GenerationSpec` s; one thread owns the model: the batching
scheduler (:mod:`kvforge.serve.scheduler`, default) or the one-at-a-time worker (:mod:`kvforge.serve.worker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kvforge.decode import PresenceFrequencyPenalty, SamplingParams
from kvforge.errors import PRESS_WITH_REUSE, UserError
from kvforge.serve import schemas as S
from kvforge.serve.errors import APIError, install_handlers, timeout_error, user_error
from kvforge.serve.features import Features
from kvforge.serve.metrics import Metrics
from kvforge.serve.middleware import GuardMiddleware
from kvforge.serve.runner import (
    KEEP,
    GenerationSpec,
    RagSpec,
    run_generation,
    runs_alone,
    split_context_question,
    split_system_question,
)
from kvforge.serve.scheduler import Scheduler
from kvforge.serve.worker import Aborted, Job, QueueFullError, ShuttingDownError, Worker
from kvforge.types import Generation

logger = logging.getLogger(__name__)

_DONE = object()
_Body = TypeVar("_Body", bound=BaseModel)
_POLL_S = 0.25  # how often a waiting non-streaming request checks for a client disconnect
SCHEDULERS = ("batched", "serial")


def create_app(
    engine: Any,
    *,
    model_name: str = "kvforge",
    store_url: str | None = None,
    reuse: Any = None,
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
        engine: the model to serve; its ``reuse`` strategy is set from ``reuse``.
        model_name: the id clients send as ``model`` (and ``/v1/models`` lists).
        store_url: where reuse keeps KV (``kvforge.store.open_store`` URL; None = in memory).
        reuse: default reuse: "prefix" | "semantic" | "none"/None, or a strategy object.
        semantic: semantic reuse's policy options (``threshold``, ``max_error``, ``verify_ratio``; None = defaults).
        press, compression_ratio: default compression (requests may override both in their ``kvforge`` field).
        max_queue: requests waiting behind the running one before 429s start.
        request_timeout_s: queueing + generation time allowed (504 after it).
        api_key: Bearer key required on ``/v1/*`` when set.
        max_body_bytes: request bodies above it get a 413.
        default_max_tokens: chat completions without ``max_tokens`` (capped at what the context has left).
        embedder: semantic reuse's embedder (None = MiniLM).
        scheduler: "batched" (continuous batching: up to ``max_running`` requests decode together, prompts are
            prefilled ``prefill_budget`` tokens per step between decode steps) or "serial" (one request at a time).
    """
    if not 0 <= compression_ratio < 1:
        raise UserError(f"compression ratio must be in [0, 1), got {compression_ratio}")
    features = Features(engine, store_url=store_url, embedder=embedder, semantic=semantic)
    reuse_kind = reuse if isinstance(reuse, str) else ("custom" if reuse is not None else "none")
    try:  # fail at startup on an unknown default press or reuse strategy
        features.press(press, compression_ratio)
        engine.reuse = features.reuse(reuse, semantic_mode, strict=True) if isinstance(reuse, str) else reuse
    except APIError as e:
        raise UserError(e.message) from e
    if scheduler not in SCHEDULERS:
        raise UserError(f"unknown scheduler {scheduler!r}; choose from: {', '.join(SCHEDULERS)}")
    batched = scheduler == "batched"
    worker: Any = Scheduler(engine, max_queue, max_running, prefill_budget) if batched else Worker(max_queue)
    stats = CachedStats(features.store_stats)
    metrics = Metrics(
        lambda: worker.depth,
        stats.get,
        model_name=model_name,
        num_running=lambda: getattr(worker, "num_running", int(worker.busy)),
        profile=worker.profile,
    )
    stats.get()  # first fetch in the background now, so the first scrape has figures
    # Body parsing, templating and tokenising run here, off the event loop, so /health answers while a 7 MiB request is
    # prepared; one thread keeps the tokenizer used by at most this thread and the worker at once.
    prep = ThreadPoolExecutor(1, thread_name_prefix="kvforge-prep")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        worker.close()  # cancels waiting jobs, stops the running one at its next token
        prep.shutdown(wait=False, cancel_futures=True)

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(prep, partial(fn, *args))

    async def parse(request: Request, model: type[_Body]) -> _Body:
        """The JSON body validated as ``model``, parsed in the prep thread (errors as FastAPI's 400s)."""
        body = await request.body()

        def validate() -> _Body:
            try:
                return model.model_validate_json(body)
            except ValidationError as e:
                raise RequestValidationError(e.errors(include_url=False)) from None

        return await off_loop(validate)  # type: ignore[no-any-return]

    app = FastAPI(title="kvforge", version="0.1.0", lifespan=lifespan)
    app.state.drain = worker.drain  # SIGTERM (commands/serve.py): stop taking work, finish the running job
    app.state.engine, app.state.worker, app.state.metrics, app.state.features = engine, worker, metrics, features
    app.add_middleware(GuardMiddleware, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes)
    install_handlers(app)

    @functools.cache
    def longest_token() -> int:
        """Characters of the longest vocabulary entry: a text needs at least len(text) / this many tokens."""
        try:
            return max(map(len, engine.tokenizer.get_vocab()), default=1) or 1
        except Exception:  # a tokenizer without a vocabulary listing: no early check
            return 2**31

    def spec_for(req: S._GenerationRequest, prompt: Any, raw: bool) -> tuple[GenerationSpec, int, str]:
        """Validate against the model (name, context, press, reuse); returns (spec, prompt tokens, reuse label)."""
        if req.model != model_name:
            raise APIError(
                404,
                f"model {req.model!r} not found; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )
        opts = req.kvforge or S.KVForgeOptions()
        if opts.rag is not None or opts.chunks is not None or opts.chunk_ids is not None or opts.recompute_ratio:
            return rag_spec_for(req, opts, prompt, raw)
        ratio = opts.compression_ratio if opts.compression_ratio is not None else compression_ratio
        press_obj = features.press(opts.press if opts.press is not None else press, ratio)
        spec_reuse, label = KEEP, reuse_kind
        if opts.reuse is not None or opts.semantic_mode is not None:
            label = opts.reuse or reuse_kind
            if opts.semantic_mode is not None and label != "semantic":
                raise APIError(400, "kvforge.semantic_mode needs semantic reuse", param="kvforge.semantic_mode")
            spec_reuse = features.reuse(label, opts.semantic_mode or semantic_mode)
        prompt_param = "prompt" if raw else "messages"
        chars = (
            len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt if isinstance(m, dict))
        )
        if chars > 2 * longest_token() * engine.max_positions:  # surely too long: no seconds of tokenising for a 400
            raise APIError(
                400,
                f"prompt of {chars} characters exceeds the model's context of {engine.max_positions} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        try:
            num_prompt = len(engine.encode_chat(prompt, raw=raw))
        except UserError as e:  # a token id outside the vocabulary, ...
            raise user_error(e, param=prompt_param) from e
        except (ValueError, TypeError) as e:
            raise APIError(400, f"cannot tokenize the prompt: {e}", param=prompt_param) from e
        room = engine.max_positions - num_prompt
        default = 16 if raw else min(default_max_tokens, room)
        max_tokens = req.max_new_tokens if req.max_new_tokens is not None else default
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        try:
            engine.check_length(num_prompt, max(max_tokens, 1))
            sampling = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=req.seed,
            )
        except UserError as e:  # the prompt alone fits: then it is max_tokens that is too large
            fits = req.max_new_tokens is not None and num_prompt < engine.max_positions
            raise user_error(e, param=tokens_param if fits else prompt_param) from e
        qa = None
        if press_obj is not None and label != "none" and (opts.query_aware is not False or label == "semantic"):
            raise APIError(400, PRESS_WITH_REUSE, param="kvforge.press")  # the engine's and the CLI's message
        if opts.quant is not None:
            if press_obj is None or opts.query_aware is not False or label == "none":
                raise APIError(
                    400,
                    "kvforge.quant sets how a compressed document is stored: it needs kvforge.press, "
                    "kvforge.query_aware=false and prefix reuse",
                    param="kvforge.quant",
                )
            check_quant_name(opts.quant, "kvforge.quant")
        if opts.query_aware is False and press_obj is not None:
            qa = split_context_question(prompt)
        elif press_obj is None and not raw and _context_mode(opts, reuse_kind, semantic_mode):
            try:  # semantic reuse of the document part: needs a 'document\n\nquestion' message
                qa = split_context_question(prompt)
            except APIError:
                qa = None  # a plain chat: ordinary generation (a miss for context mode)
        spec = GenerationSpec(prompt, raw, max_tokens, sampling, req.stop_list, press_obj, spec_reuse, qa, opts.quant)
        spec.logprobs = req.num_logprobs
        if req.presence_penalty or req.frequency_penalty:
            spec.processors.append(PresenceFrequencyPenalty(req.presence_penalty or 0.0, req.frequency_penalty or 0.0))
        check_supported(req, spec)
        return spec, num_prompt, label

    def rag_spec_for(
        req: S._GenerationRequest, opts: S.KVForgeOptions, prompt: Any, raw: bool
    ) -> tuple[GenerationSpec, int, str]:
        """A chat answered over document chunks (RAG chunk reuse); any option it cannot combine with is a 400."""
        if opts.rag is None:
            raise APIError(400, "kvforge.chunks, chunk_ids and recompute_ratio need kvforge.rag", param="kvforge.rag")
        if raw:
            raise APIError(400, "RAG chunk reuse takes a chat request (/v1/chat/completions)", param="kvforge.rag")
        for name in ("press", "compression_ratio", "reuse", "semantic_mode", "query_aware"):
            if getattr(opts, name) is not None:
                raise APIError(400, f"kvforge.rag cannot be combined with kvforge.{name} yet", param=f"kvforge.{name}")
        if press is not None:
            raise APIError(
                400, "kvforge.rag cannot be combined with the server's default press yet", param="kvforge.rag"
            )
        if (opts.chunks is None) == (opts.chunk_ids is None):
            raise APIError(
                400,
                "kvforge.rag needs exactly one of kvforge.chunks (texts) or kvforge.chunk_ids",
                param="kvforge.chunks",
            )
        if opts.recompute_ratio is not None and opts.rag not in ("cacheblend", "cacheclip"):
            raise APIError(
                400, "kvforge.recompute_ratio applies to cacheblend and cacheclip", param="kvforge.recompute_ratio"
            )
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        question, system = split_system_question(prompt, "messages")
        strategy = features.chunk_reuse(opts.rag, opts.recompute_ratio)
        chunks = opts.chunks if opts.chunks is not None else features.chunk_texts(strategy, opts.chunk_ids or [])
        try:
            ids = strategy.build_prompt(chunks, question, system=system).ids()
        except ValueError as e:
            raise APIError(400, str(e), param="kvforge.chunks") from e
        max_tokens = (
            req.max_new_tokens
            if req.max_new_tokens is not None
            else min(default_max_tokens, engine.max_positions - len(ids))
        )
        try:
            engine.check_length(len(ids), max(max_tokens, 1))
        except UserError as e:
            raise user_error(e, param=tokens_param if req.max_new_tokens is not None else "messages") from e
        sampling = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
        )
        rag = RagSpec(strategy, list(chunks), question, system)
        spec = GenerationSpec(prompt, raw, max_tokens, sampling, req.stop_list, None, KEEP, None, rag=rag)
        check_supported(req, spec)
        return spec, len(ids), f"rag:{opts.rag}"

    def check_supported(req: S._GenerationRequest, spec: GenerationSpec) -> None:
        """A field this server accepts but cannot honour in this combination is a 400 naming it."""
        # the one-at-a-time worker, and the batch for what it runs whole through the Engine (RAG chunks, query-agnostic
        # compression), run Engine.generate/answer, which have no logits processors
        if not batched or runs_alone(spec):
            for name in ("presence_penalty", "frequency_penalty", "logprobs"):
                if getattr(req, name) not in (None, 0, 0.0, False):
                    why = "a request without kvforge.rag" if spec.rag is not None else "no query-agnostic press"
                    if not batched:
                        why = "the batched scheduler (--scheduler batched)"
                    raise APIError(400, f"{name} needs {why}", param=name)
        if spec.logprobs is not None and req.stream:
            raise APIError(400, "logprobs are not supported with stream=true", param="logprobs")

    def submit(fn: Callable[[Job], Any], spec: GenerationSpec | None = None, deltas: Any = None) -> Job:
        """Queue ``fn`` (or, batched, the generation ``spec``; its text deltas go to the ``deltas`` queue)."""
        loop = asyncio.get_running_loop()

        def put(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
                loop.call_soon_threadsafe(deltas.put_nowait, item)

        emit = put if deltas is not None else None
        try:
            if spec is not None and batched:
                return worker.submit_generation(  # type: ignore[no-any-return]
                    spec, loop, request_timeout_s, emit, (lambda: put(_DONE)) if deltas is not None else None
                )
            if spec is not None:

                def fn(job: Job) -> Generation:
                    try:
                        return run_generation(engine, spec, job, emit)
                    finally:
                        if deltas is not None:
                            put(_DONE)

            return worker.submit(fn, loop, request_timeout_s)  # type: ignore[no-any-return]
        except QueueFullError as e:
            metrics.rejected.inc()
            raise _queue_full(e) from e
        except ShuttingDownError as e:
            raise _shutting_down() from e

    def kvforge_field(gen: Generation, job: Job, label: str, opts: S.KVForgeOptions | None) -> dict[str, Any]:
        info = gen.info.get("reuse") or {}
        kind = info.get("kind", "none")  # "none": the engine did not look (no strategy, or a press was active)
        if info and label != "none":
            metrics.observe_reuse(label, kind)
        metrics.ttft.labels(job.endpoint).observe(gen.ttft_s)
        metrics.queue_wait.observe((job.started or job.submitted) - job.submitted)
        metrics.prompt_tokens.inc(gen.prompt_tokens)
        metrics.reused_tokens.inc(gen.reused_tokens)
        metrics.completion_tokens.inc(len(gen.token_ids))
        queue_s = (job.started or job.submitted) - job.submitted
        metrics.vllm.observe(
            queue_s,
            gen.ttft_s,
            time.monotonic() - job.submitted,
            gen.info.get("token_times", []),
            gen.prompt_tokens,
            len(gen.token_ids),
            bool(info),
            gen.reused_tokens,
            gen.finish_reason,
        )
        ratio = opts.compression_ratio if opts and opts.compression_ratio is not None else compression_ratio
        press_name = opts.press if opts and opts.press is not None else press
        return {
            "reuse": kind,
            "reused_tokens": gen.reused_tokens,
            "recomputed_tokens": gen.prompt_tokens - gen.reused_tokens,
            "approximate": bool(info.get("approximate", False)),
            "similarity": info.get("similarity"),
            "miss_reason": info.get("reason"),
            "ttft_s": round(gen.ttft_s, 6),
            "queue_s": round((job.started or job.submitted) - job.submitted, 6),
            "press": press_name,
            "compression_ratio": ratio if press_name else None,
            "cache_bytes": gen.cache_bytes,
            "compressed": bool(info.get("compressed", False)),  # the reused document was stored compressed
            "bytes_loaded": info.get("bytes_loaded"),
            "quant": info.get("quant"),
        } | ({"rag": _rag_field(info)} if kind == "chunks" else {})

    async def wait(request: Request, job: Job, until_started: bool = False) -> Any:
        """The job's result (with ``until_started``: True once it runs).

        A client that goes away or a deadline that passes cancels the job; one the worker refused as too late is a 429.
        """
        started = asyncio.ensure_future(job.started_event.wait())
        try:
            while True:
                done, _ = await asyncio.wait({job.future, started} if until_started else {job.future}, timeout=_POLL_S)
                if job.future in done or (until_started and started in done):
                    break
                if time.monotonic() > job.deadline:
                    job.cancel("timeout")
                    break
                if await request.is_disconnected():
                    job.cancel("cancelled")
                    break
        finally:
            started.cancel()
        if until_started and job.started_event.is_set() and job.abort_reason is None:
            return True
        if isinstance(job.future.exception() if job.future.done() else None, QueueFullError):
            metrics.rejected.inc()
            raise _queue_full(job.future.exception())  # type: ignore[arg-type]
        if not job.future.done() or isinstance(job.future.exception(), Aborted):
            reason = job.abort_reason or "cancelled"
            metrics.aborted.labels(reason).inc()
            if reason == "timeout":
                raise timeout_error(request_timeout_s)
            if reason == "shutdown":
                raise _shutting_down()
            return None  # type: ignore[return-value]  # client gone: nobody reads the answer
        exc = job.future.exception()
        if isinstance(exc, UserError):
            raise user_error(exc) from exc
        if exc is not None:
            raise exc
        return job.future.result()  # type: ignore[no-any-return]

    async def generate(request: Request, req: S._GenerationRequest, prompt: Any, raw: bool, endpoint: str) -> Response:
        spec, _, label = await off_loop(spec_for, req, prompt, raw)
        rid = S.new_id("cmpl" if raw else "chatcmpl")
        if req.stream:
            return await stream(request, req, spec, label, rid, endpoint)
        job = submit(None, spec)  # type: ignore[arg-type]
        job.endpoint = endpoint
        gen = await wait(request, job)
        if gen is None:
            return Response(status_code=499)
        kvf = kvforge_field(gen, job, label, req.kvforge)
        usage = S.usage(gen.prompt_tokens, len(gen.token_ids), gen.reused_tokens)
        finish = gen.finish_reason
        records = gen.info.get("logprobs")
        token_text = lambda t: engine.tokenizer.decode([t])  # noqa: E731
        if raw:
            text = (prompt if isinstance(prompt, str) and getattr(req, "echo", False) else "") + gen.text
            lp = S.completion_logprobs(records, token_text) if records is not None else None
            return JSONResponse(S.completion_body(rid, model_name, text, finish, usage, kvf, logprobs=lp))
        lp = S.chat_logprobs(records, token_text) if records is not None else None
        return JSONResponse(S.chat_body(rid, model_name, gen.text, finish, usage, kvf, logprobs=lp))

    async def stream(
        request: Request, req: S._GenerationRequest, spec: GenerationSpec, label: str, rid: str, endpoint: str
    ) -> Response:
        raw = spec.raw
        deltas: asyncio.Queue[Any] = asyncio.Queue()
        job = submit(None, spec, deltas)  # type: ignore[arg-type]  # a full queue is a 429 before the stream starts
        job.endpoint = endpoint
        if await wait(request, job, until_started=True) is not True:  # queueing happens before the 200 is sent
            return Response(status_code=499)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: dict[str, Any] | None, text: str, finish: str | None) -> dict[str, Any]:
            if raw:
                return S.completion_body(rid, model_name, text, finish, None, None, chunk=True)
            return S.chat_chunk(rid, model_name, delta, finish)

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
                        metrics.aborted.labels("timeout").inc()
                        yield S.sse(timeout_error(request_timeout_s).body())
                        return
                    if item is _DONE:
                        break
                    yield S.sse(chunk({"content": item}, item, None))
                try:
                    gen: Generation = await asyncio.wait_for(asyncio.shield(job.future), timeout=30.0)
                except Aborted as e:
                    metrics.aborted.labels(e.reason).inc()
                    error = _shutting_down() if e.reason == "shutdown" else timeout_error(request_timeout_s)
                    yield S.sse(error.body())
                    return
                except UserError as e:
                    yield S.sse(user_error(e).body())
                    return
                except Exception as e:  # already streaming: the error travels as an event
                    logger.exception("generation failed")
                    yield S.sse(APIError(500, f"internal error: {type(e).__name__}", type="server_error").body())
                    return
                kvf = kvforge_field(gen, job, label, req.kvforge)
                usage = S.usage(gen.prompt_tokens, len(gen.token_ids), gen.reused_tokens)
                last = chunk({}, "", gen.finish_reason)
                last["kvforge"] = kvf
                yield S.sse(last)
                if include_usage:
                    final = S.completion_body(rid, model_name, "", None, usage, None) if raw else chunk(None, "", None)
                    if raw:
                        final["choices"] = []
                    final["usage"] = usage
                    yield S.sse(final)
                yield "data: [DONE]\n\n"
            finally:
                if not job.future.done() and job.abort_reason is None:  # the client went away mid-stream
                    job.cancel("cancelled")
                    metrics.aborted.labels("cancelled").inc()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------------------------------------ routes
    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model_name,
            "queue_depth": worker.depth,
            "busy": worker.busy,
            "running": getattr(worker, "num_running", int(worker.busy)),
            "scheduler": scheduler,
            "reuse": reuse_kind,
            "press": press,
            "store": features.has_store,
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [S.model_card(model_name)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        if name != model_name:
            raise APIError(404, f"model {name!r} not found", param="model", code="model_not_found")
        return S.model_card(model_name)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, S.CompletionRequest)
        return await generate(request, req, req.prompt, True, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, S.ChatCompletionRequest)
        return await generate(request, req, req.chat(), False, "/v1/chat/completions")

    @app.post("/v1/kv/documents")
    async def documents(request: Request) -> Response:
        req = await parse(request, S.DocumentsRequest)
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"model {req.model!r} not found", param="model", code="model_not_found")
        strategy = engine.reuse if req.mode == "prefix" and reuse_kind == "prefix" else None
        if req.mode == "prefix" and strategy is None:
            strategy = await off_loop(
                partial(features.reuse, "prefix", strict=True)
            )  # storing needs the store: 503 when it is down
        press_obj = None
        if req.press is not None or req.quant is not None or req.compression_ratio is not None:
            if req.mode != "prefix" or req.press is None:
                raise APIError(400, "press, compression_ratio and quant store prefix documents compressed: they need "
                               "mode 'prefix' and a press", param="press")  # fmt: skip
            press_obj = features.press(req.press, compression_ratio if req.compression_ratio is None
                                       else req.compression_ratio)  # fmt: skip
            if req.quant is not None:
                check_quant_name(req.quant, "quant")
        job = submit(
            lambda j: features.precompute_documents(
                req.documents, req.mode, req.system, strategy, press=press_obj, quant=req.quant
            )
        )
        job.endpoint = "/v1/kv/documents"
        result = await wait(request, job)
        if result is None:
            return Response(status_code=499)
        return JSONResponse({"object": "list", "data": result})

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


def check_quant_name(quant: str, param: str) -> None:
    """400 for an unknown storage quantisation name (the store's own message with the choices)."""
    try:
        from kvforge.store.quant import parse_scheme

        parse_scheme(quant)
    except ImportError as e:
        raise APIError(400, "quantised storage needs kvforge.store", param=param) from e
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e


def _rag_field(info: dict[str, Any]) -> dict[str, Any]:
    """What RAG chunk reuse did: method, ratio, chunks found stored (hits) or computed now (misses), token counts."""
    keys = ("method", "recompute_ratio", "chunks", "chunk_hits", "chunk_misses", "recomputed_tokens", "fresh_tokens")
    return {k: info.get(k) for k in keys}


def _context_mode(opts: S.KVForgeOptions, server_kind: str, server_mode: str) -> bool:
    """Whether this request's reuse is semantic in context mode."""
    if opts.reuse is None and opts.semantic_mode is None:
        return server_kind == "semantic" and server_mode == "context"
    kind = opts.reuse or server_kind
    return kind == "semantic" and (opts.semantic_mode or server_mode) == "context"


def _shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down; retry on another replica",
        type="server_error",
        code="shutting_down",
        headers={"Retry-After": "1"},
    )


def _queue_full(e: QueueFullError) -> APIError:
    return APIError(
        429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": str(e.retry_after_s)}
    )
