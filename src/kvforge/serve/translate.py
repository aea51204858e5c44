"""OpenAI bodies -> kvforge :class:`~kvforge.request.Request` s, validated and tokenised (once) off the model thread.

Every option is checked against the model, the registries and each other here, so a request that cannot work is a
400 naming its field before it waits for the model; the request that goes on carries its tokens.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

from kvforge.decode import PresenceFrequencyPenalty, SamplingParams
from kvforge.engine import Engine
from kvforge.errors import STORES_DOCUMENTS, UserError, check_combination
from kvforge.names import RAG_RECOMPUTING
from kvforge.presses.base import Press
from kvforge.request import Chunks, Document, Prompt, Request
from kvforge.reuse.base import ReuseStrategy, StoresCompressedDocuments
from kvforge.serve import schemas as S
from kvforge.serve.errors import APIError, user_error
from kvforge.serve.features import Features
from kvforge.store.quant import parse_scheme


@dataclass
class ServerOptions:
    """A server's defaults: what requests get when they do not say (see :func:`kvforge.serve.create_app`)."""

    model_name: str = "kvforge"
    reuse_kind: str = "none"
    semantic_mode: str = "canonical"
    press: str | None = None
    compression_ratio: float = 0.5
    default_max_tokens: int = 256
    request_timeout_s: float = 300.0


@dataclass
class Translated:
    """A request ready for the engine, and the labels its answer reports."""

    request: Request
    label: str  # the reuse kind asked for (metrics), "rag:<method>" for chunks
    press: str | None
    compression_ratio: float | None


class Translator:
    """Builds engine requests from OpenAI bodies for one server."""

    def __init__(self, engine: Engine, features: Features, options: ServerOptions) -> None:
        self.engine, self.features, self.options = engine, features, options

    # ------------------------------------------------------------------------------------------ generations
    def generation(self, req: S._GenerationRequest, prompt: Any, raw: bool) -> Translated:
        """A completion (``raw``) or a chat completion as a tokenised request."""
        o, opts = self.options, req.kvforge or S.KVForgeOptions()
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM answer it
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if opts.rag is not None or opts.chunks is not None or opts.chunk_ids is not None or opts.recompute_ratio:
            return self._rag(req, opts, prompt, raw)
        ratio = opts.compression_ratio if opts.compression_ratio is not None else o.compression_ratio
        press_name = opts.press if opts.press is not None else o.press
        press = self.features.press(press_name, ratio, client=opts.press is not None)
        reuse, label = self._reuse(opts)
        if label != "none":  # the engine's rule, before the request queues
            try:
                check_combination(press=press is not None, stores_documents=self._stores_documents(reuse, label),
                                  query_aware=opts.query_aware is not False, window=self.engine.window is not None,
                                  decoding_budget=self.engine.decoding_press is not None)  # fmt: skip
            except UserError as e:
                raise APIError(400, str(e), param="kvforge.press" if press is not None else "kvforge.reuse") from e
        if opts.quant is not None:
            if press is None or opts.query_aware is not False or label == "none":
                raise APIError(400, "kvforge.quant sets how a compressed document is stored: it needs kvforge.press, "
                               "kvforge.query_aware=false and prefix reuse", param="kvforge.quant")  # fmt: skip
            check_quant_name(opts.quant, "kvforge.quant")
        body: Prompt = prompt
        if opts.query_aware is False and press is not None:
            body = Document(*split_context_question(prompt))
            if label in ("prefix", "document"):  # a compressed document is stored and reused whole
                reuse = self.features.reuse("document") or False
        elif press is None and not raw and self._context_mode(opts):
            with contextlib.suppress(APIError):  # a plain chat: ordinary generation (a miss for context mode)
                body = Document(*split_context_question(prompt))  # semantic reuse of the document part
        request = Request(body, raw=raw, press=press, query_aware=opts.query_aware is not False, reuse=reuse,
                          quant=opts.quant, stop=req.stop_list, logprobs=req.num_logprobs,
                          ignore_eos=req.ignore_eos)  # fmt: skip
        if req.presence_penalty or req.frequency_penalty:
            request.processors = [PresenceFrequencyPenalty(req.presence_penalty or 0.0, req.frequency_penalty or 0.0)]
        self._tokenise(req, request, prompt, "prompt" if raw else "messages", default=16 if raw else None)
        if request.logprobs is not None and req.stream:
            raise APIError(400, "logprobs are not supported with stream=true", param="logprobs")
        return Translated(request, label, press_name if press is not None else None, ratio if press else None)

    def _reuse(self, opts: S.KVForgeOptions) -> tuple[ReuseStrategy | bool, str]:
        """(the request's strategy: True = the engine's, False = none; its label)."""
        o = self.options
        if opts.reuse is None and opts.semantic_mode is None:
            return True, o.reuse_kind
        label = opts.reuse or o.reuse_kind
        if opts.semantic_mode is not None and label != "semantic":
            raise APIError(400, "kvforge.semantic_mode needs semantic reuse", param="kvforge.semantic_mode")
        strategy = self.features.reuse(label, opts.semantic_mode or o.semantic_mode)
        return (strategy if strategy is not None else False), label

    def _stores_documents(self, reuse: ReuseStrategy | bool, label: str) -> bool:
        """Whether the request's reuse stores a compressed document (by name, or the operator's own strategy)."""
        strategy = self.engine.reuse if reuse is True else reuse
        return label in STORES_DOCUMENTS or isinstance(strategy, StoresCompressedDocuments)

    def _context_mode(self, opts: S.KVForgeOptions) -> bool:
        """Whether this request's reuse is semantic in context mode."""
        o = self.options
        if opts.reuse is None and opts.semantic_mode is None:
            return o.reuse_kind == "semantic" and o.semantic_mode == "context"
        kind = opts.reuse or o.reuse_kind
        return kind == "semantic" and (opts.semantic_mode or o.semantic_mode) == "context"

    def _rag(self, req: S._GenerationRequest, opts: S.KVForgeOptions, prompt: Any, raw: bool) -> Translated:
        """A chat answered over document chunks (RAG chunk reuse); any option it cannot combine with is a 400."""
        if opts.rag is None:
            raise APIError(400, "kvforge.chunks, chunk_ids and recompute_ratio need kvforge.rag", param="kvforge.rag")
        if raw:
            raise APIError(400, "RAG chunk reuse takes a chat request (/v1/chat/completions)", param="kvforge.rag")
        for name in ("press", "compression_ratio", "reuse", "semantic_mode", "query_aware"):
            if getattr(opts, name) is not None:
                raise APIError(400, f"kvforge.rag cannot be combined with kvforge.{name} yet", param=f"kvforge.{name}")
        if self.options.press is not None:
            raise APIError(400, "kvforge.rag cannot be combined with the server's default press yet",
                           param="kvforge.rag")  # fmt: skip
        if (opts.chunks is None) == (opts.chunk_ids is None):
            raise APIError(400, "kvforge.rag needs exactly one of kvforge.chunks (texts) or kvforge.chunk_ids",
                           param="kvforge.chunks")  # fmt: skip
        if opts.recompute_ratio is not None and opts.rag not in RAG_RECOMPUTING:
            raise APIError(400, f"kvforge.recompute_ratio applies to {', '.join(RAG_RECOMPUTING)}",
                           param="kvforge.recompute_ratio")  # fmt: skip
        question, system = split_system_question(prompt, "messages")
        strategy = self.features.chunk_reuse(opts.rag, opts.recompute_ratio)
        texts = opts.chunks if opts.chunks is not None else self.features.chunk_texts(strategy, opts.chunk_ids or [])
        request = Request(Chunks(list(texts), question, system), reuse=strategy, stop=req.stop_list,
                          logprobs=req.num_logprobs, ignore_eos=req.ignore_eos)  # fmt: skip
        if req.presence_penalty or req.frequency_penalty:
            request.processors = [PresenceFrequencyPenalty(req.presence_penalty or 0.0, req.frequency_penalty or 0.0)]
        self._tokenise(req, request, prompt, "messages", default=None)
        return Translated(request, f"rag:{opts.rag}", None, None)

    def _tokenise(
        self, req: S._GenerationRequest, request: Request, prompt: Any, param: str, default: int | None
    ) -> None:
        """Tokenise ``request`` once; set its sampling and max_new_tokens (default: what the context has left)."""
        engine = self.engine
        self._check_chars(_num_chars(prompt), "prompt", param)  # surely too long: no seconds of tokenising
        request.max_new_tokens = 0
        try:
            num_prompt = len(engine.encode(request).ids)
        except UserError as e:  # a token id outside the vocabulary, a prompt longer than the context...
            raise user_error(e, param=param) from e
        except (ValueError, TypeError) as e:
            raise APIError(400, f"cannot tokenize the prompt: {e}", param=param) from e
        room = engine.max_positions - num_prompt
        max_tokens = req.max_new_tokens if req.max_new_tokens is not None else default or min(
            self.options.default_max_tokens, room)  # fmt: skip
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        try:
            engine.check_length(num_prompt, max(max_tokens, 1))
            request.sampling = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=req.seed,
            )
        except UserError as e:  # the prompt alone fits: then it is max_tokens that is too large
            raise user_error(e, param=tokens_param if req.max_new_tokens is not None else param) from e
        request.max_new_tokens = max(max_tokens, 1)

    # ------------------------------------------------------------------------------------------ documents
    def documents(self, req: S.DocumentsRequest, strategy: ReuseStrategy, press: Press | None) -> list[Request]:
        """One store-only request per document (``Document(text)`` without a question, nothing generated)."""
        out = []
        for i, doc in enumerate(req.documents):
            self._check_chars(len(doc), "document", f"documents[{i}]")
            request = Request(Document(doc, None, req.system), max_new_tokens=0, press=press, query_aware=False,
                              reuse=strategy, quant=req.quant)  # fmt: skip
            try:
                self.engine.encode(request)
            except UserError as e:
                raise user_error(e, param=f"documents[{i}]") from e
            out.append(request)
        return out

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.options.model_name:
            raise APIError(404, f"model {name!r} not found; this server serves {self.options.model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    # ------------------------------------------------------------------------------------------ sizes
    def check_sizes(self, body: Any, partial: bool = False) -> None:
        """Refuse a parsed JSON body whose prompt, messages or documents are surely longer than the context, from
        their sizes alone (a 400 ``context_length_exceeded``), and one naming another model (404).

        Runs on large bodies before the schema validates them: a million token ids are refused by their count, not
        validated one by one. Cheap on what fits (a length per list, a character count per text); what it lets
        through is checked exactly by validation and tokenising, with the same messages. ``partial``: ``body`` was
        parsed from a prefix of the request, so its sizes are lower bounds (the messages say "at least").
        """
        if not isinstance(body, dict):
            return  # the schema's message (not an object)
        model = body.get("model")
        if isinstance(model, str):  # a partial parse leaves out a string cut off: a model present is whole
            self.check_model(model)
        limit, least = self.engine.max_positions, "at least " if partial else ""
        prompt = body.get("prompt")
        for part in prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)) else [prompt]:
            if isinstance(part, list) and len(part) > limit:  # token ids: one token each
                raise APIError(400, f"prompt of {least}{len(part)} tokens exceeds the model's context of {limit} "
                               "tokens", param="prompt", code="context_length_exceeded")  # fmt: skip
            if isinstance(part, str):
                self._check_chars(len(part), "prompt", "prompt")
        messages = body.get("messages")
        if isinstance(messages, list):
            if len(messages) > limit:  # a chat template gives each message a token at least
                raise APIError(400, f"{least}{len(messages)} messages exceed the model's context of {limit} tokens",
                               param="messages", code="context_length_exceeded")  # fmt: skip
            self._check_chars(sum(map(_content_chars, messages)), "prompt", "messages", least)
        documents = body.get("documents")
        if isinstance(documents, list):
            for i, doc in enumerate(documents):
                if isinstance(doc, str):
                    self._check_chars(len(doc), "document", f"documents[{i}]")

    def _check_chars(self, chars: int, what: str, param: str, least: str = "") -> None:
        """400 when a text of ``chars`` characters surely exceeds the context (no token is longer than the
        tokenizer's longest vocabulary entry; twice that, for the byte-level fallbacks)."""
        if chars > 2 * self._longest_token * self.engine.max_positions:
            raise APIError(400, f"{what} of {least}{chars} characters exceeds the model's context of "
                           f"{self.engine.max_positions} tokens", param=param,
                           code="context_length_exceeded")  # fmt: skip

    @functools.cached_property
    def _longest_token(self) -> int:
        """Characters of the longest vocabulary entry: a text needs at least len(text) / this many tokens."""
        try:
            return max(map(len, self.engine.tokenizer.get_vocab()), default=1) or 1
        except Exception:  # a tokenizer without a vocabulary listing: no early check
            return 2**31


def _num_chars(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(map(_content_chars, prompt))
    return 0


def _content_chars(message: Any) -> int:
    """Characters of a raw (unvalidated) chat message's text content; 0 for anything else."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def check_quant_name(quant: str, param: str) -> None:
    """400 for an unknown storage quantisation name (the store's own message with the choices)."""
    try:
        parse_scheme(quant)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e


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
