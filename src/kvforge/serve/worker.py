"""One model, one worker thread, a bounded queue: generations run one at a time, in arrival order.

A :class:`Job` carries a cancel flag and a deadline; the generation checks them on every token (``job.check()`` from
the engine's ``on_token`` callback) and aborts by raising :class:`Aborted`, so a client that disconnects or times out
stops costing compute at its next token. Results go back to the asyncio side through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


SHED_FACTOR = 1.5  # a job starts only with this many average job times left before its deadline


class ThreadProfile:
    """Where the model thread's time goes: seconds per phase, and counts (``/metrics``, the load benchmark).

    Phases: the batching scheduler's ``admit`` (tokenise + reuse plan: store reads), ``prefill_alone`` (parts with a
    press), ``forward`` (the steps' packed forwards), ``finish`` (answers + reuse records: store writes), ``exclusive``
    (work run alone between steps), ``idle``; the one-at-a-time worker's ``generate`` and ``idle``. Counts:
    ``steps``, ``decode_rows`` (decode tokens summed over the steps), ``prefill_tokens``.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._since = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._since
        self._since = now

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


class QueueFullError(Exception):
    """The queue holds ``max_queue`` waiting jobs already."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__("server busy: the request queue is full")
        self.retry_after_s = retry_after_s


class ShuttingDownError(Exception):
    """The server is stopping: no new work is taken."""


class Aborted(Exception):
    """A job stopped before its end: ``reason`` is "cancelled" (client gone) or "timeout"."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Job:
    """One unit of work for the worker thread, awaited by one request."""

    def __init__(self, fn: Callable[[Job], Any], loop: asyncio.AbstractEventLoop, timeout_s: float | None) -> None:
        self.fn = fn
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()
        self.submitted = time.monotonic()
        self.deadline = self.submitted + timeout_s if timeout_s else math.inf
        self.started: float | None = None
        self.started_event = asyncio.Event()  # set (on the loop) when the worker starts the job
        self.endpoint = ""  # for metrics labels
        self._abort: str | None = None
        # an abandoned job's result is never awaited: retrieve it so asyncio does not log it as lost
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the generation to stop at its next token (or never to start)."""
        if self._abort is None:
            self._abort = reason

    @property
    def abort_reason(self) -> str | None:
        if self._abort is None and time.monotonic() > self.deadline:
            self._abort = "timeout"
        return self._abort

    def check(self) -> None:
        """Raise :class:`Aborted` when the job was cancelled or ran past its deadline (called per token)."""
        reason = self.abort_reason
        if reason is not None:
            raise Aborted(reason)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop (from the worker thread); a closed loop drops it."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(fn, *args)

    def _resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        def done() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        self.call_soon(done)


class Worker:
    """Runs jobs one at a time on a daemon thread; at most ``max_queue`` wait behind the running one."""

    def __init__(self, max_queue: int = 16) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.running: Job | None = None
        self.avg_job_s = 1.0  # moving average, for Retry-After
        self.num_done = 0
        self.draining = False
        self.profile = ThreadProfile()
        self._thread = threading.Thread(target=self._loop, name="kvforge-worker", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the running one)."""
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self.running is not None

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.avg_job_s * (self.depth + 1)))

    def expected_wait_s(self) -> float:
        """Time until a job queued now would start, from the average job time (0 before any job completed)."""
        return self.avg_job_s * (self.depth + self.busy) if self.num_done else 0.0

    def submit(self, fn: Callable[[Job], Any], loop: asyncio.AbstractEventLoop, timeout_s: float | None) -> Job:
        """Queue ``fn(job)``.

        Raises :class:`QueueFullError` when ``max_queue`` jobs already wait, or when the jobs ahead would take longer
        than ``timeout_s`` (refusing now beats timing out later: the client can retry elsewhere).
        """
        if self.draining:
            raise ShuttingDownError("the server is shutting down")
        if timeout_s and self.expected_wait_s() + SHED_FACTOR * (self.avg_job_s if self.num_done else 0) > timeout_s:
            raise QueueFullError(self.retry_after_s())
        job = Job(fn, loop, timeout_s)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFullError(self.retry_after_s()) from None
        return job

    def _loop(self) -> None:
        while True:
            self.profile.lap("generate")
            job = self._queue.get()
            self.profile.lap("idle")
            if job is None:
                return
            reason = job.abort_reason
            if reason is not None:  # gone or expired while waiting: do not start it
                job._resolve(error=Aborted(reason))
                continue
            if self.num_done and job.deadline - time.monotonic() < SHED_FACTOR * self.avg_job_s:
                job._resolve(error=QueueFullError(self.retry_after_s()))  # would time out: refuse it now
                continue
            self.running = job
            job.started = time.monotonic()
            job.call_soon(job.started_event.set)
            result: Any = None
            error: BaseException | None = None
            try:
                result = job.fn(job)
                elapsed = time.monotonic() - job.started  # completed jobs only feed the estimate
                self.avg_job_s = 0.8 * self.avg_job_s + 0.2 * elapsed if self.num_done else elapsed
                self.num_done += 1
            except Aborted as e:
                logger.info("generation stopped: %s", e.reason)
                error = e
            except BaseException as e:  # the request answers with the error; the worker keeps going
                error = e
            finally:
                self.running = None  # idle BEFORE the answer is delivered: a caller woken by it sees an idle worker
            job._resolve(result=result, error=error)

    def drain(self, grace_s: float) -> None:
        """Shutdown's first step (SIGTERM): take no more jobs, cancel the waiting ones (reason "shutdown"), and give
        the running one ``grace_s`` seconds to finish before it is stopped at its next token."""
        self.draining = True
        self._cancel_waiting("shutdown")
        running = self.running
        if running is not None:
            timer = threading.Timer(grace_s, running.cancel, args=("shutdown",))
            timer.daemon = True
            timer.start()

    def _cancel_waiting(self, reason: str) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.cancel(reason)
                job._resolve(error=Aborted(reason))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after the running job; waiting jobs are cancelled."""
        self.draining = True
        self._cancel_waiting("cancelled")
        if self.running is not None:
            self.running.cancel()
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
