"""What the worker thread runs for one request: a generation (with its press and reuse strategy) and its text deltas."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvforge.decode import SamplingParams, trim_at_stop
from kvforge.serve.errors import APIError
from kvforge.serve.worker import Job
from kvforge.types import Generation

KEEP = object()  # reuse: leave the engine's own strategy in place


@dataclass
class GenerationSpec:
    """One request, translated from the OpenAI schema into Engine arguments.

    Args:
        prompt: text (raw or one user message), chat messages, or token ids, as :meth:`Engine.generate` takes.
        raw: no chat template (``/v1/completions``).
        reuse: the reuse strategy for this request, None for no reuse, or :data:`KEEP` for the engine's own.
        qa: ``(context, question, system)`` of a ``document\n\nquestion`` chat, run by :meth:`Engine.answer`: with a
            press, query-agnostic compression (the press sees the context only; with prefix reuse the compressed
            document is stored and reused); without, semantic reuse in context mode matches the document and
            prefills the question exactly.
        quant: storage quantisation of a compressed document (None: the store's).
        rag: RAG chunk reuse: :meth:`Engine.answer_chunks` over these chunks with this strategy.
    """

    prompt: Any
    raw: bool
    max_tokens: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    press: Any = None
    reuse: Any = KEEP
    qa: tuple[str, str, str | None] | None = None
    quant: str | None = None
    rag: RagSpec | None = None
    processors: list[Any] = field(default_factory=list)  # logits processors (presence/frequency penalties)
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the k most likely


@dataclass
class RagSpec:
    """A chat answered over document chunks: ``strategy`` (a ``ChunkReuse``), the chunk texts, question, system."""

    strategy: Any
    chunks: list[str]
    question: str
    system: str | None = None


class DeltaStream:
    """Token ids -> text deltas that never show a stop string (text that might start one is held back)."""

    def __init__(self, tokenizer: Any, stop: list[str], emit: Callable[[str], None] | None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.emit = emit
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        if self.emit is None:
            return
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # half of a multi-byte character
        safe = trim_at_stop(text, self.stop) if self.stop else text
        end = len(safe) if len(safe) < len(text) else len(safe) - self.hold
        if end > len(self.sent) and safe.startswith(self.sent):
            self._send(safe[len(self.sent) : end])

    def finish(self, text: str) -> None:
        """Send what is left of the final ``text`` (the generation's, trimmed at its stop string)."""
        if self.emit is not None and text.startswith(self.sent) and len(text) > len(self.sent):
            self._send(text[len(self.sent) :])

    def _send(self, delta: str) -> None:
        self.sent += delta
        assert self.emit is not None
        self.emit(delta)


@contextmanager
def engine_reuse(engine: Any, strategy: Any) -> Iterator[None]:
    """Use ``strategy`` for the generations inside (the worker runs one at a time, so swapping is safe)."""
    if strategy is KEEP:
        yield
        return
    previous = engine.reuse
    engine.reuse = strategy
    try:
        yield
    finally:
        engine.reuse = previous


def run_generation(engine: Any, spec: GenerationSpec, job: Job, emit: Callable[[str], None] | None) -> Generation:
    """Run ``spec`` on ``engine`` in the worker thread; ``job.check()`` on every token aborts a cancelled job."""
    stream = DeltaStream(engine.tokenizer, spec.stop, emit)

    token_times: list[float] = []

    def on_token(token: int) -> None:
        job.check()
        token_times.append(time.perf_counter())
        stream(token)

    job.check()
    with engine_reuse(engine, spec.reuse):
        if spec.rag is not None:
            gen = engine.answer_chunks(
                spec.rag.chunks,
                spec.rag.question,
                rag=spec.rag.strategy,
                system=spec.rag.system,
                max_new_tokens=spec.max_tokens,
                sampling=spec.sampling,
                stop=spec.stop or None,
                on_token=on_token,
            )
        elif spec.qa is not None:
            context, question, system = spec.qa
            gen = engine.answer(
                context,
                question,
                system=system,
                press=spec.press,
                query_aware=spec.press is None,
                max_new_tokens=spec.max_tokens,
                sampling=spec.sampling,
                stop=spec.stop or None,
                quant=spec.quant,
                on_token=on_token,
            )
        else:
            gen = engine.generate(
                spec.prompt,
                spec.max_tokens,
                sampling=spec.sampling,
                stop=spec.stop or None,
                raw=spec.raw,
                press=spec.press,
                on_token=on_token,
            )
    gen.info.setdefault("token_times", token_times)
    stream.finish(gen.text)
    return gen


def runs_alone(spec: GenerationSpec) -> bool:
    """Specs the batch scheduler runs whole through the Engine between two steps, not in the batch: RAG chunks
    (:meth:`Engine.answer_chunks`) and query-agnostic compression (:meth:`Engine.answer`: the press sees the document
    alone, and with prefix reuse the compressed document is stored or loaded)."""
    return spec.rag is not None or (spec.qa is not None and spec.press is not None)


def split_system_question(messages: Any, param: str) -> tuple[str, str | None]:
    """(question, system) of a ``[system?, user]`` chat (RAG requests: the user message is the question)."""
    roles = [m["role"] for m in messages] if isinstance(messages, list) else []
    if roles not in (["user"], ["system", "user"]) or not messages[-1]["content"].strip():
        raise APIError(
            400, "RAG chunk reuse takes one user message (the question) and an optional system one", param=param
        )
    return messages[-1]["content"], messages[0]["content"] if roles[0] == "system" else None


def split_context_question(messages: Any) -> tuple[str, str, str | None]:
    """(context, question, system) of a ``[system?, user]`` chat whose user message is ``context\\n\\nquestion``."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise APIError(400, "kvforge.query_aware=false needs a chat request", param="kvforge.query_aware")
    roles = [m["role"] for m in messages]
    if roles not in (["user"], ["system", "user"]):
        raise APIError(
            400,
            "kvforge.query_aware=false takes one user message (and an optional system one)",
            param="kvforge.query_aware",
        )
    context, sep, question = messages[-1]["content"].rpartition("\n\n")
    if not sep or not context.strip() or not question.strip():
        raise APIError(
            400, "kvforge.query_aware=false needs a user message 'context\\n\\nquestion'", param="kvforge.query_aware"
        )
    return context, question, messages[0]["content"] if roles[0] == "system" else None
