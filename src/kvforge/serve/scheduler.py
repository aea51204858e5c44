"""Continuous batching for the server: every running request decodes in one forward per step, prefills are chunked.

One thread owns the model. Each loop iteration (a *step*):

1. admits waiting requests while fewer than ``max_running`` run (tokenising and the reuse plan happen here);
2. runs one forward (:func:`kvforge.batch.mixed_step`) for the next token of every decoding request together with up
   to ``prefill_budget`` prompt tokens: chunks of the prefilling requests, least work left first (a long prompt takes
   several steps, so streaming users keep getting tokens between its chunks, and reuse hits do not wait behind it).

A request leaves as soon as it ends (EOS, stop string, budget), is cancelled (client gone) or passes its deadline:
cancellation is seen at the next step, prefill included. Other work (``/v1/kv/documents``) runs as an exclusive job
between steps. The :class:`~kvforge.serve.worker.Job` objects and errors are the one-at-a-time worker's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvforge.batch import Sequence, mixed_step
from kvforge.cache import KVCache
from kvforge.decode import DecodeState, trim_at_stop
from kvforge.errors import UserError
from kvforge.serve.runner import KEEP, DeltaStream, GenerationSpec, run_generation, runs_alone
from kvforge.serve.worker import SHED_FACTOR, Aborted, Job, QueueFullError, ShuttingDownError, ThreadProfile
from kvforge.types import Generation

logger = logging.getLogger(__name__)


class GenerationJob(Job):
    """A generation waiting for (or in) the batch: its spec, and how its text deltas and end reach the request."""

    def __init__(
        self,
        spec: GenerationSpec | None,
        loop: Any,
        timeout_s: float | None,
        emit: Callable[[str], None] | None = None,
        close: Callable[[], None] | None = None,
        fn: Callable[[Job], Any] | None = None,
    ) -> None:
        super().__init__(fn or (lambda j: None), loop, timeout_s)
        self.spec, self.emit = spec, emit
        self.close: Callable[[], None] = close or (lambda: None)


@dataclass
class _Active:
    """A request admitted to the batch: prompt parts still to prefill, then its decoding :class:`Sequence`."""

    job: GenerationJob
    spec: GenerationSpec
    stream: DeltaStream
    parts: list[tuple[list[int], Any]]  # (token ids, press) to prefill in order
    close: Callable[[], None]
    cache: KVCache | None = None
    logits: Any = None
    offset: int = 0  # tokens of parts[0] prefilled so far
    prompt_tokens: int = 0
    plan: Any = None
    record: Callable[[KVCache], None] | None = None  # stores the prompt's KV after the answer (reuse)
    started: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)


class Scheduler:
    """Runs generations batched on ``engine``; same interface as :class:`~kvforge.serve.worker.Worker` plus
    :meth:`submit_generation`.

    Args:
        max_running: requests decoding or prefilling together (the batch size).
        max_queue: requests waiting for a place in the batch before 429s start.
        prefill_budget: prompt tokens prefilled per step (a long prompt is split into chunks of this size).
    """

    def __init__(self, engine: Any, max_queue: int = 16, max_running: int = 16, prefill_budget: int = 128) -> None:
        if max_queue < 1 or max_running < 1 or prefill_budget < 1:
            raise ValueError("max_queue, max_running and prefill_budget must be >= 1")
        self.engine = engine
        self.max_queue, self.max_running, self.prefill_budget = max_queue, max_running, prefill_budget
        self._waiting: deque[GenerationJob] = deque()
        self._cond = threading.Condition()
        self.prefilling: list[_Active] = []
        self.decoding: list[Sequence] = []
        self.exclusive: Job | None = None
        self.draining = False
        self._closed = False
        self.avg_job_s = 1.0  # moving average of a request's time in the batch (admission to end)
        self.finish_rate = 0.0  # requests finished per second (moving average), 0 until measured
        self._last_finish: float | None = None
        self._avg_gap = 0.0
        self.num_done = 0
        self.profile = ThreadProfile()
        self._thread = threading.Thread(target=self._loop, name="kvforge-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ worker interface
    @property
    def depth(self) -> int:
        """Requests waiting for a place in the batch."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding) + (self.exclusive is not None)

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
        """Queue ``fn(job)`` to run alone between two steps (document precompute)."""
        return self._enqueue(GenerationJob(None, loop, timeout_s, fn=fn))

    def submit_generation(
        self,
        spec: GenerationSpec,
        loop: Any,
        timeout_s: float | None,
        emit: Callable[[str], None] | None = None,
        close: Callable[[], None] | None = None,
    ) -> Job:
        """Queue a generation; ``emit(text delta)`` streams it, ``close()`` is called once it ended in any way."""
        return self._enqueue(GenerationJob(spec, loop, timeout_s, emit, close))

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
            self._abort(job, "shutdown")
        running = [a.job for a in self.prefilling] + [s.tag.job for s in self.decoding]
        for job in running:
            timer = threading.Timer(grace_s, job.cancel, args=("shutdown",))
            timer.daemon = True
            timer.start()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self.draining = self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            self._cond.notify()
        for job in waiting:
            self._abort(job, "cancelled")
        self._thread.join(timeout_s)
        for active in self.prefilling + [s.tag for s in self.decoding]:
            self._abort(active.job, "cancelled", active)

    # ------------------------------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        profile = self.profile
        while True:
            with self._cond:
                profile.lap("other")
                while not self._closed and not self._waiting and not self.prefilling and not self.decoding:
                    self._cond.wait()
                profile.lap("idle")
                if self._closed:
                    return
                admitted = []
                while self._waiting and len(self.prefilling) + len(self.decoding) + len(admitted) < self.max_running:
                    admitted.append(self._waiting.popleft())
            for job in admitted:
                self._admit(job)
            self._drop_aborted()
            profile.lap("admit")
            if self.prefilling or self.decoding:
                self._step()

    def _admit(self, job: GenerationJob) -> None:
        reason = job.abort_reason
        if reason is not None:  # gone or expired while waiting: never started
            self._abort(job, reason)
            return
        if self.num_done and job.spec is not None and job.deadline - time.monotonic() < SHED_FACTOR * self.avg_job_s:
            job._resolve(error=QueueFullError(self.retry_after_s()))  # would time out in the batch: refuse it now
            job.close()
            return
        job.started = time.monotonic()
        job.call_soon(job.started_event.set)
        spec = job.spec
        if spec is None:
            self._run_exclusive(job)
            return
        if runs_alone(spec):  # RAG chunks, query-agnostic compression: the Engine runs it whole, between two steps
            job.fn = lambda j: run_generation(self.engine, spec, j, job.emit)
            try:
                self._run_exclusive(job)
            finally:
                job.close()
            return
        try:
            self.prefilling.append(self._prepare(job, spec))
        except BaseException as e:  # a bad prompt answers this request only
            job._resolve(error=e)
            job.close()

    def _run_exclusive(self, job: Job) -> None:
        self.profile.lap("admit")
        self.exclusive = job
        result: Any = None
        error: BaseException | None = None
        try:
            result = job.fn(job)
        except BaseException as e:
            error = e
        finally:
            self.exclusive = None
            self.profile.lap("exclusive")
        job._resolve(result=result, error=error)

    def _prepare(self, job: GenerationJob, spec: GenerationSpec) -> _Active:
        """Tokenise, look up reuse, list the parts to prefill (what :mod:`kvforge.serve.runner` does in one go)."""
        engine = self.engine
        strategy = engine.reuse if spec.reuse is KEEP else spec.reuse
        stream = DeltaStream(engine.tokenizer, spec.stop, job.emit)
        active = _Active(job, spec, stream, [], job.close)
        if spec.qa is not None:
            context, question, system = spec.qa
            ctx_ids, q_ids = engine.encode_qa(context, question, system=system)
            ids, text = ctx_ids + q_ids, question  # (with a press, runs_alone: never here)
            from kvforge.reuse import PromptContext

            reuse_context: Any = PromptContext(context, len(ctx_ids)) if ctx_ids and q_ids else None
        else:
            ids = engine.encode_chat(spec.prompt, raw=spec.raw)
            text, reuse_context = None, None
        engine.check_length(len(ids), spec.max_tokens)
        active.prompt_tokens = len(ids)
        if strategy is None or spec.press is not None:
            active.parts = [(ids, spec.press)]
            return active
        if engine.window is not None:
            raise UserError("KV reuse does not support a sliding-window cache (--window)")
        if spec.qa is None:
            from kvforge.reuse.query import user_query  # the user's words, not the chat template

            text, reuse_context = user_query(engine.tokenizer, spec.prompt, ids, raw=spec.raw)
        plan = engine.plan(ids, text=text, context=reuse_context, reuse=strategy)
        engine.check_length(len(plan.token_ids), spec.max_tokens)
        active.plan, active.cache, active.parts = plan, plan.cache, [(list(plan.prefill_ids), None)]
        active.record = lambda cache: strategy.record(ids, cache, text=text, context=reuse_context)
        return active

    def _chunks(self) -> list[tuple[_Active, int]]:
        """This step's prompt chunks, ``(request, tokens)`` within ``prefill_budget`` tokens.

        The requests with the least prompt left go first (reuse hits start decoding at once instead of waiting behind
        a long new prompt: shortest remaining work first), and the oldest prefilling request always gets at least a
        quarter of the budget, so a long prompt progresses whatever arrives after it.
        """
        plain = [a for a in self.prefilling if a.parts[0][1] is None]
        if not plain:
            return []

        def left(a: _Active) -> int:
            return len(a.parts[0][0]) - a.offset

        take = {id(plain[0]): min(left(plain[0]), max(1, self.prefill_budget // 4))}
        room = self.prefill_budget - take[id(plain[0])]
        for active in sorted(plain, key=left):  # stable: equal work keeps arrival order
            extra = min(left(active) - take.get(id(active), 0), room)
            if extra > 0:
                take[id(active)] = take.get(id(active), 0) + extra
                room -= extra
        return [(a, take[id(a)]) for a in plain if take.get(id(a))]

    def _prefill_alone(self, active: _Active) -> None:
        """A part with a press is prefilled in one go (the press scores the whole part), outside the batch."""
        ids, press = active.parts[0]
        try:
            active.cache, active.logits = self.engine.prefill(ids[active.offset :], active.cache, press=press)
        except BaseException as e:
            self.prefilling.remove(active)
            active.job._resolve(error=e)
            active.close()
            return
        self.profile.count("prefill_tokens", len(ids) - active.offset)
        self._part_done(active, len(ids) - active.offset)

    def _part_done(self, active: _Active, num_tokens: int) -> None:
        """``num_tokens`` more of the current part are prefilled; a request with nothing left starts decoding."""
        active.offset += num_tokens
        if active.offset == len(active.parts[0][0]):
            active.parts.pop(0)
            active.offset = 0
        if not active.parts:
            self.prefilling.remove(active)
            self.decoding.append(self._sequence(active))

    def _step(self) -> None:
        """One forward: the next token of every decoding request and this step's prompt chunks, packed together."""
        for active in [a for a in self.prefilling if a.parts[0][1] is not None]:
            self._prefill_alone(active)
        self.profile.lap("prefill_alone")
        chosen = self._chunks()
        for active, _ in chosen:
            if active.cache is None:
                active.cache = self.engine.new_cache()
        chunks = [(a.parts[0][0][a.offset : a.offset + n], a.cache) for a, n in chosen]
        running = self.decoding
        try:
            going, logits = mixed_step(self.engine.model, running, chunks)  # type: ignore[arg-type]
        except BaseException as e:  # the forward failed: every request of the step answers with the error
            logger.exception("batched step failed")
            self.decoding = []
            failed = [s.tag for s in running] + [a for a, _ in chosen]
            self.prefilling = [a for a in self.prefilling if all(a is not f for f in failed)]
            for active in failed:
                active.job._resolve(error=e)
                active.close()
            return
        self.profile.count("steps")
        self.profile.count("decode_rows", len(going))
        self.profile.count("prefill_tokens", sum(n for _, n in chosen))
        kept = {id(s) for s in going}
        self.decoding = going  # then the requests whose prompt this step completed join (first token: next step)
        for (active, n), row in zip(chosen, logits, strict=True):
            active.logits = row
            self._part_done(active, n)
        self.profile.lap("forward")
        for seq in running:
            if id(seq) not in kept:
                self._finish(seq)
        self.profile.lap("finish")

    def _sequence(self, active: _Active) -> Sequence:
        spec, engine = active.spec, self.engine
        stream = active.stream

        def on_token(token: int) -> None:
            active.token_times.append(time.perf_counter())
            stream(token)

        state = DecodeState(
            spec.max_tokens,
            spec.sampling,
            eos_token_ids=engine.eos_token_ids,
            stop=spec.stop,
            tokenizer=engine.tokenizer,
            on_token=on_token,
            processors=spec.processors,
            logprobs=spec.logprobs,
        )
        assert active.cache is not None
        return Sequence(active.cache, active.logits, state, tag=active)

    def _finish(self, seq: Sequence) -> None:
        active: _Active = seq.tag
        engine, state = self.engine, seq.state
        text = engine.tokenizer.decode(state.tokens, skip_special_tokens=True)
        if active.spec.stop:
            text = trim_at_stop(text, active.spec.stop)
        now = time.perf_counter()
        first = active.token_times[0] if active.token_times else now
        gen = Generation(
            text=text,
            token_ids=list(state.tokens),
            prompt_tokens=active.prompt_tokens,
            ttft_s=first - active.started,
            decode_s=now - first,
            finish_reason=state.finish_reason or "length",
            cache_bytes=seq.cache.nbytes(),
        )
        gen.info.update(seq.cache.info)
        gen.info["token_times"] = active.token_times
        if state.num_logprobs is not None:
            gen.info["logprobs"] = state.logprobs
        if active.plan is not None:
            gen.reused_tokens = active.plan.reused_tokens
            gen.info["reuse"] = active.plan.summary()
        if active.record is not None:
            try:
                active.record(seq.cache)
            except Exception as e:  # storing is best effort: the answer is already computed
                logger.warning("reuse record failed: %s", type(e).__name__)
        elapsed = now - active.started
        self.avg_job_s = 0.9 * self.avg_job_s + 0.1 * elapsed if self.num_done else elapsed
        if self._last_finish is not None:  # mean gap between two ends -> finish rate
            gap = now - self._last_finish
            self._avg_gap = 0.9 * self._avg_gap + 0.1 * gap if self._avg_gap else gap
            self.finish_rate = 1.0 / max(self._avg_gap, 1e-3)
        self._last_finish = now
        self.num_done += 1
        active.stream.finish(gen.text)
        active.job._resolve(result=gen)
        active.close()

    def _drop_aborted(self) -> None:
        for active in list(self.prefilling):
            if (reason := active.job.abort_reason) is not None:
                self.prefilling.remove(active)
                self._abort(active.job, reason, active)
        for seq in list(self.decoding):
            if (reason := seq.tag.job.abort_reason) is not None:
                self.decoding.remove(seq)
                self._abort(seq.tag.job, reason, seq.tag)

    def _abort(self, job: GenerationJob, reason: str, active: _Active | None = None) -> None:
        job.cancel(reason)
        job._resolve(error=Aborted(reason))
        job.close()
