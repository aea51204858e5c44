"""The unit of work: a :class:`Request` (prompt parts, press, reuse, sampling, stop, streaming, deadline), and its
tokens (:class:`Encoded`), computed once by :func:`encode` on any thread before the engine plans it.

A prompt is one of:

- chat text, chat messages or token ids (``raw=True``: text without the chat template);
- :class:`Document` + question: the document is the reusable part (a query-agnostic press compresses it alone; a
  document strategy stores it compressed); ``question=None`` only computes and stores the document;
- :class:`Chunks` + question: RAG, each chunk's KV stored on its own and reused wherever the chunk lands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvforge.decode import SamplingParams
from kvforge.errors import UserError
from kvforge.reuse.base import ChatContext, PromptContext
from kvforge.reuse.rag.prompt import RagPrompt, build_prompt

if TYPE_CHECKING:
    from kvforge.presses.base import Press
    from kvforge.reuse.base import ReuseStrategy

__all__ = ["Chunks", "Document", "Encoded", "Prompt", "Request", "encode", "encode_chat", "encode_qa", "encode_turn"]


@dataclass(frozen=True)
class Document:
    """A document and a question about it (``question=None``: compute and store the document, answer nothing)."""

    text: str
    question: str | None = None
    system: str | None = None
    answer_prefix: str = ""


@dataclass(frozen=True)
class Chunks:
    """A question over document chunks (RAG): ``system + chunk_1 + separator + ... + chunk_n + separator + question``
    (each chunk's KV is stored on its own)."""

    texts: Sequence[str]
    question: str
    system: str | None = None
    separator: str = "\n\n"
    answer_prefix: str = ""


Prompt = str | list[dict[str, str]] | list[int] | Document | Chunks


@dataclass
class Encoded:
    """A prompt's tokens and what reuse needs to know about them.

    Args:
        ids: every prompt token, in order.
        text: the text a semantic strategy embeds (what the user wrote: the question for documents and chunks, the
            last user message of a chat; None when it cannot be told apart from the template).
        context: the reusable part (:class:`~kvforge.reuse.base.PromptContext` for a document, the RAG prompt for
            chunks), or for a chat the conversation before the user's last message
            (:class:`~kvforge.reuse.base.ChatContext`); None for raw text and token ids.
        press_size: how many leading ids a press compresses (all of them query-aware; the document query-agnostic).
    """

    ids: list[int]
    text: str | None = None
    context: PromptContext | ChatContext | RagPrompt | None = None
    press_size: int = 0


@dataclass
class Request:
    """One generation, whatever its press or reuse strategy: what :meth:`kvforge.engine.Engine.add` takes.

    Args:
        prompt: chat text / messages / token ids, a :class:`Document` or :class:`Chunks`.
        max_new_tokens: new tokens at most (0: prefill and record only, e.g. storing a document).
        sampling, stop: how tokens are picked, stop strings (the text is cut before them).
        raw: text without the chat template.
        press: compress the prompt while prefilling it; ``query_aware=False`` compresses a document before its
            question is seen (the compressed document can then be stored and reused by any later question).
        reuse: True: the engine's strategy; False: none; or a strategy for this request.
        quant: storage quantisation of a compressed document (None: the store's own).
        on_token: called with every emitted token id (streaming).
        on_prefill: called with (prompt tokens done, total) after each prefill chunk (progress bars).
        deadline: ``time.monotonic()`` past which the engine stops the request (``Sequence.error``: "timeout").
        processors: logits processors (presence/frequency penalties); logprobs: alternatives per token to report.
        ignore_eos: keep generating past the end-of-sequence token (exactly ``max_new_tokens`` tokens unless a stop
            string or the deadline ends it first; what load tests and benchmarks need).
    """

    prompt: Prompt
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    raw: bool = False
    press: Press | None = None
    query_aware: bool = True
    reuse: ReuseStrategy | bool = True
    quant: str | None = None
    on_token: Callable[[int], None] | None = None
    on_prefill: Callable[[int, int], None] | None = None
    deadline: float | None = None
    processors: Sequence[Any] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    encoded: Encoded | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise UserError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.press is not None and isinstance(self.prompt, Chunks):
            raise UserError("a press does not combine with RAG chunk reuse yet")
        if isinstance(self.prompt, Document) and self.prompt.question is None and self.max_new_tokens:
            raise UserError("a document without a question is only stored: max_new_tokens must be 0")


# ---------------------------------------------------------------------------------------------------------- tokens
def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _chat_text(tokenizer: Any, prompt: str | list[dict[str, str]], raw: bool) -> tuple[str, bool]:
    """(the text a chat prompt is tokenised from, whether the tokenizer adds its special tokens)."""
    if isinstance(prompt, str) and (raw or not has_chat_template(tokenizer)):
        return prompt, True
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not has_chat_template(tokenizer):
        return "\n\n".join(m["content"] for m in messages), True  # type: ignore[index]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), False


def encode_chat(tokenizer: Any, prompt: str | list[dict[str, str]] | list[int], raw: bool = False) -> list[int]:
    """Token ids of ``prompt``: a string (a user message unless ``raw``), a message list, or ids (taken as they are)."""
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        return [int(t) for t in prompt]  # type: ignore[arg-type]
    text, add_special = _chat_text(tokenizer, prompt, raw)  # type: ignore[arg-type]
    return list(tokenizer(text, add_special_tokens=add_special).input_ids)


def encode_turn(
    tokenizer: Any, prompt: str | list[dict[str, str]], raw: bool = False
) -> tuple[list[int], str | None, ChatContext | None]:
    """(token ids, what the user wrote last, the conversation before it) of a chat prompt, tokenised once.

    The text a semantic strategy embeds is the user's last message, never the chat template or a system prompt around
    it (the same in every prompt, they make any two prompts look alike: "What is the capital of austria?" and "...
    of Australia?" have cosine 0.71 as written, 0.91 inside SmolLM2's template). Raw text (or a model without a chat
    template) is all the user's. When the user's words cannot be located in the prompt's tokens (a chat not ending
    with a user message, a template that rewrites it, a tokenizer without offsets) the text is None: nothing to match,
    a semantic miss rather than a guess.
    """
    text, add_special = _chat_text(tokenizer, prompt, raw)
    if isinstance(prompt, str) and (raw or not has_chat_template(tokenizer)):
        return list(tokenizer(text, add_special_tokens=add_special).input_ids), prompt, None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    last = messages[-1] if messages else {}
    content = last.get("content") if isinstance(last, dict) else None
    start = -1
    if last.get("role") == "user" and isinstance(content, str) and content.strip():
        start = text.rfind(content)
        start = start if start >= 0 else text.rfind(content.strip())  # a template that trims the message
    try:
        enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=start >= 0)
    except (NotImplementedError, TypeError, ValueError):  # a slow tokenizer has no offsets
        start, enc = -1, tokenizer(text, add_special_tokens=add_special)
    ids = list(enc.input_ids)
    if start < 0:
        return ids, None, None
    offsets = enc.offset_mapping
    split = next((i for i, (s, e) in enumerate(offsets) if e > start and not (s == e == 0 and i == 0)), len(ids))
    if split == 0:
        return ids, content, None
    history = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages[:-1] if isinstance(m.get("content"), str))
    return ids, content, ChatContext(history, split)


def encode_qa(
    tokenizer: Any, context: str, question: str, system: str | None = None, answer_prefix: str = ""
) -> tuple[list[int], list[int]]:
    """Split ONE prompt (context, then question, then the assistant header) into context ids and question ids.

    ``ctx_ids + q_ids`` is exactly the tokenisation of the whole prompt; the split falls at the first token that
    starts at or after the question (a token straddling the boundary goes to the question part).
    """
    sep = "\n\n"
    content = f"{context}{sep}{question}" if context else question
    if has_chat_template(tokenizer):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        add_special = False
    else:
        text = (f"{system}{sep}" if system else "") + content + "\n"
        add_special = True
    text += answer_prefix
    question_start = text.rfind(question) if question else len(text)
    if context and question:
        question_start = text.rfind(sep + question) + len(sep)
    enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
    ids, offsets = list(enc.input_ids), enc.offset_mapping
    split = next(
        (i for i, (s, e) in enumerate(offsets) if e > question_start and not (s == e == 0 and i == 0)), len(ids)
    )
    return ids[:split], ids[split:]


def encode(tokenizer: Any, request: Request) -> Encoded:
    """The request's tokens (what the engine plans, loads and prefills); touches no model, so any thread may run it."""
    prompt, press = request.prompt, request.press
    if isinstance(prompt, Chunks):
        try:
            rag = build_prompt(
                tokenizer, list(prompt.texts), prompt.question, prompt.system, prompt.separator, prompt.answer_prefix
            )
        except ValueError as e:
            raise UserError(str(e)) from e
        return Encoded(rag.ids(), prompt.question, rag)
    if isinstance(prompt, Document):
        if prompt.question is None:  # store the document alone: the context part of a prompt with any question
            ctx_ids, _ = encode_qa(tokenizer, prompt.text, "?", prompt.system, prompt.answer_prefix)
            context = PromptContext(prompt.text, len(ctx_ids), press=press, quant=request.quant)
            return Encoded(ctx_ids, prompt.text, context, len(ctx_ids))
        ctx_ids, q_ids = encode_qa(tokenizer, prompt.text, prompt.question, prompt.system, prompt.answer_prefix)
        agnostic = press is not None and not request.query_aware and bool(q_ids)
        context = None
        if ctx_ids and q_ids:
            context = PromptContext(prompt.text, len(ctx_ids), press=press if agnostic else None, quant=request.quant)
        press_size = len(ctx_ids) if agnostic else len(ctx_ids) + len(q_ids)
        return Encoded(ctx_ids + q_ids, prompt.question, context, press_size)
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        ids = encode_chat(tokenizer, prompt)  # token ids: the text is theirs (raw completions: no template added)
        return Encoded(ids, tokenizer.decode(ids, skip_special_tokens=True), None, len(ids))
    ids, text, chat = encode_turn(tokenizer, prompt, raw=request.raw)  # type: ignore[arg-type]
    return Encoded(ids, text, chat, len(ids))
