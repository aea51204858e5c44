"""The server's model thread: queueing, admission and deadlines around :meth:`kvforge.engine.Engine.step`.

Requests arrive tokenised (the routes encode them off this thread). Each loop iteration:

1. admits waiting requests while fewer than ``max_running`` run: ``engine.add`` plans and loads them (store reads);
2. ends the requests whose client left or whose deadline passed;
3. runs one ``engine.step()`` (what a step holds, and which prompt goes first, is the engine's: :mod:`kvforge.schedule`)
   and answers the requests that finished in it.

Other work (storing RAG chunks through ``/v1/kv/documents``) runs alone between two steps.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvforge.engine import Engine
from kvforge.errors import Aborted
from kvforge.request import Request
from kvforge.sequence import Sequence
from kvforge.serve.jobs import SHED_FACTOR, Job, QueueFullError, ShuttingDownError, ThreadProfile
from kvforge.serve.stream import DeltaStream

logger = logging.getLogger(__name__)


class GenerationJob(Job):
    """A request waiting for (or in) the engine: the kvforge ``Request``, or ``fn`` to run alone between steps."""

    def __init__(
        self,
        request: Request | None,
        loop: Any,
        timeout_s: float | None,
        fn: Callable[[Job], Any] | None = None,
        close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(fn or (lambda j: None), loop, timeout_s)
        self.request = request
        self.stream: DeltaStream | None = None
        self.close: Callable[[], None] = close or (lambda: None)


class Scheduler:
    """Runs requests on ``engine`` on one model thread.

    Args:
        max_queue: requests waiting for a place in the batch before 429s start.
        max_running: requests in the engine at once (1: one at a time).
    """

    def __init__(self, engine: Engine, max_queue: int = 16, max_running: int = 16) -> None:
        if max_queue < 1 or max_running < 1:
            raise ValueError("max_queue and max_running must be >= 1")
        self.engine = engine
        self.max_queue, self.max_running = max_queue, max_running
        self._waiting: deque[GenerationJob] = deque()
        self._cond = threading.Condition()
        self.exclusive: Job | None = None
        self.draining = False
        self._closed = False
        self.avg_job_s = 1.0  # moving average of a request's time in the engine (admission to end)
        self.finish_rate = 0.0  # requests finished per second (moving average), 0 until measured
        self._last_finish: float | None = None
        self._avg_gap = 0.0
        self.num_done = 0
        self.profile = ThreadProfile()
        self.profile.counts = engine.stats
        self._thread = threading.Thread(target=self._loop, name="kvforge-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ queue
    @property
    def depth(self) -> int:
        """Requests waiting for a place in the engine."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.engine.running) + (self.exclusive is not None)

    @property
    def busy(self) -> bool:
        return self.num_running > 0

    def retry_after_s(self) -> int:
        return max(1, round(self.expected_wait_s() or self.avg_job_s))

    def expected_wait_s(self) -> float:
        """Time until a request queued now would be admitted, from the measured finish rate (0 before any)."""
        if self.num_done < 4 or self.finish_rate <= 0:
            return 0.0
        ahead = len(self._waiting) + max(0, self.num_running - self.max_running + 1)
        return ahead / self.finish_rate

    def submit(self, fn: Callable[[Job], Any], loop: Any, timeout_s: float | None) -> Job:
        """Queue ``fn(job)`` to run alone between two steps."""
        return self._enqueue(GenerationJob(None, loop, timeout_s, fn=fn))

    def submit_request(
        self,
        request: Request,
        loop: Any,
        timeout_s: float | None,
        emit: Callable[[str], None] | None = None,
        close: Callable[[], None] | None = None,
    ) -> Job:
        """Queue a request; ``emit(text delta)`` streams it, ``close()`` is called once it ended in any way."""
        job = GenerationJob(request, loop, timeout_s, close=close)
        job.stream = DeltaStream(self.engine.tokenizer, list(request.stop), emit)
        request.on_token = job.stream
        request.deadline = None if math.isinf(job.deadline) else job.deadline
        return self._enqueue(job)

    def _enqueue(self, job: GenerationJob) -> GenerationJob:
        with self._cond:
            if self.draining:
                raise ShuttingDownError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(self.retry_after_s())
            # refusing now beats a timeout later: the queue ahead plus the request's own time must fit its deadline
            expected = self.expected_wait_s() + (SHED_FACTOR * self.avg_job_s if self.num_done else 0.0)
            if job.deadline - time.monotonic() < expected:
                raise QueueFullError(self.retry_after_s())
            self._waiting.append(job)
            self._cond.notify()
        return job

    def drain(self, grace_s: float) -> None:
        """SIGTERM: take no more work, cancel the waiting requests, give the running ones ``grace_s`` seconds."""
        with self._cond:
            self.draining = True
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            _abort(job, "shutdown")
        for seq in [s for s in self.engine.running if s.tag is not None]:
            timer = threading.Timer(grace_s, seq.tag.cancel, args=("shutdown",))
            timer.daemon = True
            timer.start()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self.draining = self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            self._cond.notify()
        for job in waiting:
            _abort(job, "cancelled")
        self._thread.join(timeout_s)
        for seq in [s for s in self.engine.running if s.tag is not None]:
            self.engine.abort(seq, Aborted("cancelled"))
            _abort(seq.tag, "cancelled")

    # ------------------------------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        profile, engine = self.profile, self.engine
        while True:
            with self._cond:
                profile.lap("other")
                while not self._closed and not self._waiting and not engine.has_work:
                    self._cond.wait()
                profile.lap("idle")
                if self._closed:
                    return
                admitted = []
                while self._waiting and len(engine.running) + len(admitted) < self.max_running:
                    admitted.append(self._waiting.popleft())
            for job in admitted:
                self._admit(job)
            for seq in [s for s in engine.running if s.tag is not None]:  # (the engine's own callers' have no job)
                if (reason := seq.tag.abort_reason) is not None:
                    engine.abort(seq, Aborted(reason))
                    _abort(seq.tag, reason)
            profile.lap("admit")
            if engine.has_work:
                for seq in engine.step():
                    if seq.tag is not None:
                        self._answer(seq)
                profile.lap("step")

    def _admit(self, job: GenerationJob) -> None:
        reason = job.abort_reason
        if reason is not None:  # gone or expired while waiting: never started
            _abort(job, reason)
            return
        if self.num_done and job.request is not None and job.deadline - time.monotonic() < SHED_FACTOR * self.avg_job_s:
            job._resolve(error=QueueFullError(self.retry_after_s()))  # would time out in the engine: refuse it now
            job.close()
            return
        job.started = time.monotonic()
        job.call_soon(job.started_event.set)
        if job.request is None:
            self._run_exclusive(job)
            return
        try:
            self.engine.add(job.request, tag=job)
        except Exception as e:  # a request that cannot be planned answers with its error; the others go on
            job._resolve(error=e)
            job.close()

    def _run_exclusive(self, job: Job) -> None:
        self.profile.lap("admit")
        self.exclusive = job
        result: Any = None
        error: BaseException | None = None
        try:
            result = job.fn(job)
        except Exception as e:
            error = e
        finally:
            self.exclusive = None
            self.profile.lap("exclusive")
        job._resolve(result=result, error=error)

    def _answer(self, seq: Sequence) -> None:
        job: GenerationJob = seq.tag
        if seq.error is not None:
            if not isinstance(seq.error, Aborted):
                logger.error("generation failed: %s: %s", type(seq.error).__name__, seq.error)
            job._resolve(error=seq.error)
            job.close()
            return
        gen = seq.result()
        now = time.perf_counter()
        elapsed = now - seq.started
        self.avg_job_s = 0.9 * self.avg_job_s + 0.1 * elapsed if self.num_done else elapsed
        if self._last_finish is not None:  # mean gap between two ends -> finish rate
            gap = now - self._last_finish
            self._avg_gap = 0.9 * self._avg_gap + 0.1 * gap if self._avg_gap else gap
            self.finish_rate = 1.0 / max(self._avg_gap, 1e-3)
        self._last_finish = now
        self.num_done += 1
        if job.stream is not None:
            job.stream.finish(gen.text)
        job._resolve(result=gen)
        job.close()


def _abort(job: GenerationJob, reason: str) -> None:
    job.cancel(reason)
    job._resolve(error=Aborted(reason))
    job.close()
