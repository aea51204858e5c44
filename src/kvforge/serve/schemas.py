"""OpenAI request and response bodies (pydantic), plus the namespaced ``kvforge`` options field.

Every field a request may carry is listed here: any other (``logit_bias``, ``tools``, ``response_format``...) is a
400 that names it, never silently ignored; so is an unknown key of the ``kvforge`` object (a typo is not a no-op).
``user`` is accepted: it names the end user and changes no output.

This is the server's one edge for values: every id, count, ratio and sampling parameter is checked (or normalised)
here, so the engine never sees a value it cannot use. Chunk ids follow the store's key rule
(:data:`kvforge.names.STORE_KEY_PATTERN`: no path, NUL, wildcard or 10k-character id gets further); counts and token
ids are bounded; a ``temperature`` is 0 (greedy) or at least :data:`kvforge.sampling.MIN_TEMPERATURE` (1e-5, below
which vLLM samples greedily: dividing logits by 1e-38 overflows), the rule every entry point shares.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    StringConstraints,
    field_validator,
    model_validator,
)

from kvforge.errors import UserError
from kvforge.names import RAG_STRATEGY_NAMES, STORE_KEY_PATTERN
from kvforge.sampling import check_temperature

REUSE_KINDS = ("prefix", "semantic", "none")
RAG_METHODS = RAG_STRATEGY_NAMES[1:]  # every strategy but "full" (a plain request is the full prefill)
SEMANTIC_MODES = ("canonical", "context")
MAX_COUNT = 2**31 - 1  # the largest max_tokens / token id accepted (anything larger is surely a mistake)

ChunkId = Annotated[str, StringConstraints(strict=True, max_length=200, pattern=STORE_KEY_PATTERN)]
Name = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=64)]  # press, quant: looked up later
Count = Annotated[StrictInt, Field(ge=1, le=MAX_COUNT)]
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]


class KVForgeOptions(BaseModel):
    """Per-request kvforge options: compression, reuse strategy, semantic mode, query-aware compression, and RAG
    chunk reuse (``rag`` method, ``recompute_ratio``, the chunks as ``chunks`` texts or ``chunk_ids`` returned by
    ``POST /v1/kv/documents`` in ``chunks`` mode; the user message is then the question)."""

    model_config = ConfigDict(extra="forbid")

    press: Name | None = None
    compression_ratio: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] | None = None
    reuse: Literal["prefix", "semantic", "none"] | None = None
    semantic_mode: Literal["canonical", "context"] | None = None
    query_aware: StrictBool | None = None
    quant: Name | None = None  # how a compressed document is stored (query_aware=false + prefix reuse)
    rag: Literal[RAG_METHODS] | None = None  # type: ignore[valid-type]
    recompute_ratio: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    chunks: Annotated[list[StrictStr], Field(min_length=1, max_length=256)] | None = None
    chunk_ids: Annotated[list[ChunkId], Field(min_length=1, max_length=256)] | None = None


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


_Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None  # OpenAI's newer name for max_tokens
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    user: StrictStr | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] | None = None  # one choice per request
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extra sampling parameter: generate max_tokens, past the end of sequence
    kvforge: KVForgeOptions | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        """0 or at least 1e-5 (:func:`kvforge.sampling.check_temperature`): the sampler never sees 1e-38."""
        if v is None:
            return None
        try:
            return check_temperature(v)
        except UserError as e:
            raise ValueError(str(e)) from None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (None: the server's default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token to report (0: the chosen token's logprob only), or None for no logprobs."""
        return None


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one raw prompt (text, or token ids), no chat template."""

    # tried left to right: a 7 MiB list of token ids is validated once as ids (0.45 s), not against every member
    prompt: Annotated[
        StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]], Field(union_mode="left_to_right")
    ]
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v  # type: ignore[no-any-return]


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict[str, str]]:
        """Messages as the tokenizer's chat template wants them (``developer`` is OpenAI's new ``system``)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class DocumentsRequest(BaseModel):
    """``POST /v1/kv/documents``: precompute the KV of documents (prefix reuse) or of RAG chunks."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    documents: Annotated[list[StrictStr], Field(min_length=1, max_length=256)]
    mode: Literal["prefix", "chunks"] = "prefix"
    system: StrictStr | None = None
    press: Name | None = None  # prefix mode: store each document compressed (query-agnostic) by this press
    compression_ratio: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] | None = None
    quant: Name | None = None  # storage quantisation (none, int8, int4, int2; default: the store's)

    @field_validator("documents")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if any(not d.strip() for d in v):
            raise ValueError("documents must be non-empty")
        return v


# ------------------------------------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    usage_: dict | None,
    kvf: dict | None,
    chunk: bool = False,
    logprobs: dict | None = None,
) -> dict[str, Any]:
    """A ``text_completion`` object (a whole one, or one SSE chunk of a stream)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }
    if usage_ is not None:
        body["usage"] = usage_
    if kvf is not None:
        body["kvforge"] = kvf
    return body


def chat_body(
    rid: str, model: str, text: str, finish: str, usage_: dict, kvf: dict, logprobs: dict | None = None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        ],
        "usage": usage_,
        "kvforge": kvf,
    }


def chat_chunk(rid: str, model: str, delta: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` gives the usage-only final chunk (empty choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": choices}


def chat_logprobs(records: list[tuple[int, float, list[tuple[int, float]]]], token_text: Any) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}`` from DecodeState records."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in top]} for t, lp, top in records]}


def completion_logprobs(records: list[tuple[int, float, list[tuple[int, float]]]], token_text: Any) -> dict[str, Any]:
    """Legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``."""
    tokens = [token_text(t) for t, _, _ in records]
    offsets, pos = [], 0
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in records],
        "top_logprobs": [{token_text(a): alp for a, alp in top} for _, _, top in records],
        "text_offset": offsets,
    }


def model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvforge"}


def sse(body: dict[str, Any]) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {json.dumps(body)}\n\n"
