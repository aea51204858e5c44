"""One served engine as the routes see it: parse and tokenise off the event loop and off the model thread, submit to
the scheduler, wait for the answer (client gone or deadline passed: the job is cancelled), report what it did."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from typing import Any, TypeVar

import pydantic_core
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from kvforge.engine import Engine
from kvforge.errors import Aborted, UserError
from kvforge.request import Request
from kvforge.serve.errors import APIError, timeout_error, user_error
from kvforge.serve.features import Features
from kvforge.serve.jobs import Job, QueueFullError, ShuttingDownError
from kvforge.serve.metrics import Metrics
from kvforge.serve.scheduler import Scheduler
from kvforge.serve.translate import ServerOptions, Translated, Translator
from kvforge.types import Generation, ReuseFacts

_Body = TypeVar("_Body", bound=BaseModel)
_POLL_S = 0.25  # how often a waiting non-streaming request checks for a client disconnect
DONE = object()  # the end of a stream's deltas
LARGE_BODY_BYTES = 256 * 2**10  # bodies over this have their sizes checked before the schema validates them


class Server:
    """The engine, its scheduler (the model thread), the translator, the features and the metrics of one app."""

    def __init__(
        self, engine: Engine, options: ServerOptions, features: Features, scheduler: Scheduler, metrics: Metrics
    ) -> None:
        self.engine, self.options, self.features = engine, options, features
        self.scheduler, self.metrics = scheduler, metrics
        self.translator = Translator(engine, features, options)
        # Body parsing, templating and tokenising run here, off the event loop and off the model thread, so /health
        # answers and generations go on while a 7 MiB request is prepared.
        self.prep = ThreadPoolExecutor(1, thread_name_prefix="kvforge-prep")

    def close(self) -> None:
        self.scheduler.close()  # cancels waiting jobs, ends the running ones
        self.prep.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.prep, partial(fn, *args))

    async def parse(self, request: HTTPRequest, model: type[_Body]) -> _Body:
        """The JSON body validated as ``model``, parsed in the prep thread (errors as FastAPI's 400s).

        A body over :data:`LARGE_BODY_BYTES` has its sizes checked against the context first (:func:`check_sizes`):
        a prompt surely too long is refused from its length, before the schema would validate each of its million
        token ids.
        """
        body = await request.body()

        def validate() -> _Body:
            if len(body) > LARGE_BODY_BYTES:
                check_sizes(body, self.translator.check_sizes)
            try:
                return model.model_validate_json(body)
            except ValidationError as e:
                raise RequestValidationError(e.errors(include_url=False)) from None

        return await self.off_loop(validate)  # type: ignore[no-any-return]

    def submit(self, request: Request | None, fn: Callable[[Job], Any] | None = None, deltas: Any = None) -> Job:
        """Queue ``request`` (its text deltas go to the ``deltas`` queue) or ``fn`` (run alone between steps)."""
        loop = asyncio.get_running_loop()

        def put(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
                loop.call_soon_threadsafe(deltas.put_nowait, item)

        timeout_s = self.options.request_timeout_s
        try:
            if request is None:
                assert fn is not None
                return self.scheduler.submit(fn, loop, timeout_s)
            emit, close = (put, lambda: put(DONE)) if deltas is not None else (None, None)
            return self.scheduler.submit_request(request, loop, timeout_s, emit, close)
        except QueueFullError as e:
            self.metrics.rejected.inc()
            raise queue_full(e) from e
        except ShuttingDownError as e:
            raise shutting_down() from e

    def submit_all(self, requests: list[Request]) -> list[Job]:
        """Queue every request, or none: when one is refused (429, shutting down) those queued before it are
        cancelled (they never start, or leave the engine at its next step)."""
        jobs: list[Job] = []
        try:
            for r in requests:
                jobs.append(self.submit(r))
        except BaseException:
            for job in jobs:
                job.cancel("cancelled")
            raise
        return jobs

    async def wait_all(self, request: HTTPRequest, jobs: list[Job]) -> list[Any] | None:
        """The results of ``jobs`` (None when the client went away): the first that fails, times out or loses its
        client cancels the others, so no work of a request that was answered keeps running."""
        try:
            results = []
            for job in jobs:
                result = await self.wait(request, job)
                if result is None:
                    break
                results.append(result)
            else:
                return results
            return None
        finally:
            for job in jobs:
                if not job.future.done():
                    job.cancel("cancelled")

    async def wait(self, request: HTTPRequest, job: Job, until_started: bool = False) -> Any:
        """The job's result (with ``until_started``: True once it runs); None when the client went away.

        A client that goes away or a deadline that passes cancels the job; one the scheduler refused as too late is a
        429.
        """
        started = asyncio.ensure_future(job.started_event.wait())
        try:
            while True:
                done, _ = await asyncio.wait(
                    {job.future, started} if until_started else {job.future},
                    timeout=_POLL_S,
                    return_when=asyncio.FIRST_COMPLETED,
                )
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
        error = job.future.exception() if job.future.done() else None
        if isinstance(error, QueueFullError):
            self.metrics.rejected.inc()
            raise queue_full(error)
        if not job.future.done() or isinstance(error, Aborted):
            reason = job.abort_reason or (error.reason if isinstance(error, Aborted) else "cancelled")
            self.metrics.aborted.labels(reason).inc()
            if reason == "timeout":
                raise timeout_error(self.options.request_timeout_s)
            if reason == "shutdown":
                raise shutting_down()
            return None  # client gone: nobody reads the answer
        if isinstance(error, UserError):
            raise user_error(error) from error
        if error is not None:
            raise error
        return job.future.result()

    def kvforge_field(self, gen: Generation, job: Job, t: Translated) -> dict[str, Any]:
        """The ``kvforge`` field of an answer (what reuse and compression did), metrics observed on the way."""
        metrics, facts = self.metrics, gen.reuse
        kind = facts.kind if facts is not None else "none"  # "none": the engine did not look (no strategy)
        if facts is not None and t.label != "none":
            metrics.observe_reuse(t.label, kind)
        queue_s = (job.started or job.submitted) - job.submitted
        metrics.ttft.labels(job.endpoint).observe(gen.ttft_s)
        metrics.queue_wait.observe(queue_s)
        metrics.prompt_tokens.inc(gen.prompt_tokens)
        metrics.reused_tokens.inc(gen.reused_tokens)
        metrics.completion_tokens.inc(len(gen.token_ids))
        metrics.vllm.observe(queue_s, gen.ttft_s, time.monotonic() - job.submitted, gen.info.get("token_times", []),
                             gen.prompt_tokens, len(gen.token_ids), facts is not None, gen.reused_tokens,
                             gen.finish_reason)  # fmt: skip
        facts = facts or ReuseFacts()
        document = facts.document
        return {
            "reuse": kind,
            "reused_tokens": gen.reused_tokens,
            "recomputed_tokens": gen.prompt_tokens - gen.reused_tokens,
            "approximate": facts.approximate,
            "similarity": None if facts.similarity is None else round(float(facts.similarity), 4),
            "miss_reason": facts.reason,
            "ttft_s": round(gen.ttft_s, 6),
            "queue_s": round(queue_s, 6),
            "press": t.press,
            "compression_ratio": t.compression_ratio,
            "cache_bytes": gen.cache_bytes,
            "compressed": document is not None and document.compressed,  # the reused document was stored compressed
            "bytes_loaded": document.bytes_loaded if document is not None else None,
            "quant": document.quant if document is not None else None,
        } | ({"rag": asdict(facts.chunks)} if facts.chunks is not None else {})


def check_sizes(body: bytes, check: Callable[[Any, bool], None], first: int = 64 * 2**10) -> None:
    """``check(value, partial)`` the JSON ``body`` parsed from growing prefixes (``first`` bytes, then 4x more each
    time; ``partial=True``), then whole.

    A prefix parses to the values it holds whole (lists cut short, strings cut off left out), so each size seen is a
    lower bound of the body's: ``check`` may refuse on it. A million token ids are refused after the first prefix,
    in a few milliseconds; a body that fits is parsed at most ~1.3x over. Each parse holds the GIL, so the event
    loop waits at most for the largest prefix that had to be read, rarely the whole body.
    """
    size = first
    while size < len(body):
        try:
            prefix = pydantic_core.from_json(body[:size], allow_partial=True)
        except ValueError:  # a prefix cut inside a UTF-8 character or a literal, or no JSON: read more
            pass
        else:
            check(prefix, True)
        size *= 4
    try:
        whole = pydantic_core.from_json(body)
    except ValueError:
        return  # not JSON: the schema's own message
    check(whole, False)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica", type="server_error",
                    code="shutting_down", headers={"Retry-After": "1"})  # fmt: skip


def queue_full(e: QueueFullError) -> APIError:
    return APIError(429, str(e), type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(e.retry_after_s)})  # fmt: skip


def get_server(request: HTTPRequest) -> Server:
    """The app's :class:`Server` (a FastAPI dependency)."""
    return request.app.state.server  # type: ignore[no-any-return]
