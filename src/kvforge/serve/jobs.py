"""What a request waits on while the model thread works: a :class:`Job` (cancel flag, deadline, future), the queue's
errors, and the model thread's time profile.

A job's cancel flag and deadline are looked at by the scheduler at every step (:mod:`kvforge.serve.scheduler`), so a
client that disconnects or times out stops costing compute at the next step. Results go back to the asyncio side
through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from kvforge.errors import Aborted

logger = logging.getLogger(__name__)


SHED_FACTOR = 1.5  # a job starts only with this many average job times left before its deadline


class ThreadProfile:
    """Where the model thread's time goes: seconds per phase, and counts (``/metrics``, the load benchmark).

    Phases: ``admit`` (the reuse plan: store reads, RAG assembly), ``step`` (the engine's steps: prefills, packed
    forwards, answers and reuse records), ``exclusive`` (work run alone between steps), ``idle``. Counts (the
    engine's): ``steps``, ``decode_rows`` (decode tokens summed over the steps), ``prefill_tokens``.
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


__all__ = ["SHED_FACTOR", "Aborted", "Job", "QueueFullError", "ShuttingDownError", "ThreadProfile"]
