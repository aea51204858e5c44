"""Compressed documents through the router: a chat whose user message starts with a stored document is served by
vLLM from the document's compressed KV; ``POST /v1/kv/documents`` compresses and stores documents.

A chat ``[system?, user]`` whose user message is ``document + "\\n\\n" + question`` is matched as ``kvforge serve``
matches one (:mod:`kvforge.vllm.client`): the document's tokens, the press with its parameters and the storage code
key it. The press comes from the request (``kvforge: {"press", "compression_ratio", "quant"}``) or the router's
``--press``. On a hit the chat becomes a ``/v1/completions`` request whose prompt is the document's placeholder and the
question's tokens, with ``kv_transfer_params`` naming the document; the answer is turned back into a chat answer
(streamed or not). A document that is not stored (or was stored for another model, press or code) is forwarded as
it came: a full prefill. Every answer says which it was (``kvforge.document`` and ``X-KVForge-Document``). When the
connector reports that the document's KV could not be loaded, a non-streamed request is asked again as the full
chat; a streamed one (its tokens already sent) ends with an error event.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from kvforge.errors import UserError
from kvforge.vllm import documents as docs
from kvforge.vllm.client import VllmDocuments, uniform_press

logger = logging.getLogger(__name__)

# chat fields a completion request takes as they are; any other field (tools, response_format, logprobs...) is
# answered by a full prefill of the chat
_SAME_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream", "stream_options",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "user", "stop_token_ids",
    "min_tokens", "skip_special_tokens", "include_stop_str_in_output",
}  # fmt: skip
_OPTIONS = {"press", "compression_ratio", "quant", "route"}


@dataclass
class DocumentRoute:
    """What the router did with a chat's document: ``hit`` (served from its KV), ``miss`` (not stored: full
    prefill), ``fallback`` (stored but not loaded: asked again in full), ``skip`` (no document to match)."""

    kind: str
    reason: str | None = None
    doc: docs.ServedDocument | None = None
    completion: dict[str, Any] | None = None

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"document": self.kind}
        if self.doc is not None:
            out |= {"document_key": self.doc.key, "document_tokens": self.doc.num_tokens,
                    "kv_slots": self.doc.num_slots}  # fmt: skip
        if self.reason:
            out["document_reason"] = self.reason
        return out

    def header(self) -> str:
        return self.kind + (f"; slots={self.doc.num_slots}; tokens={self.doc.num_tokens}" if self.kind == "hit" else "")


@dataclass
class DocumentRouter:
    """Matches chats to stored compressed documents and stores new ones, for the model vLLM serves.

    Args:
        base: documents for the served model (its tokenizer and fingerprint, the store; the engine loads on the
            first store request).
        press, compression_ratio, quant: the router's defaults (``--press``; None: only requests that name a press
            are matched).
        max_model_len: the upstream's context (a chat without ``max_tokens`` may fill it).
        model_folder: what kvforge's engine loads to compress documents.
    """

    base: VllmDocuments
    press: str | None = None
    compression_ratio: float = 0.75
    quant: str | None = None
    max_model_len: int | None = None
    model_folder: str | None = None
    _clients: dict[tuple[Any, ...], VllmDocuments] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def client(self, press: str | None, ratio: float, quant: str | None) -> VllmDocuments:
        """The documents of one press, ratio and code (built once, sharing the tokenizer and the engine)."""
        key = (press, ratio, quant)
        with self._lock:
            found = self._clients.get(key)
            if found is None:
                press_obj = uniform_press(press, ratio) if press else None
                if quant is not None:
                    from kvforge.store.base import check_quant

                    quant = check_quant(quant)
                found = self._clients[key] = replace(self.base, press=press_obj, quant=quant, _reuse=None)
            return found

    # ------------------------------------------------------------------------------------------ match
    def options(self, body: dict[str, Any]) -> tuple[str, float, str | None] | str:
        """(press, ratio, code) a chat asks its document under, or why it is not matched."""
        opts = body.get("kvforge") if isinstance(body.get("kvforge"), dict) else {}
        unknown = set(opts) - _OPTIONS
        if unknown:
            return f"unknown kvforge options {sorted(unknown)}"
        press = opts.get("press", self.press)
        if not press:
            return "no press (the request's kvforge.press or the router's --press)"
        ratio = opts.get("compression_ratio", self.compression_ratio)
        return str(press), float(ratio), opts.get("quant", self.quant)

    def match(self, body: dict[str, Any]) -> DocumentRoute:
        """Look a chat's document up (tokenising it; no KV is read)."""
        from kvforge.serve.errors import APIError
        from kvforge.serve.translate import split_context_question

        found = self.options(body)
        if isinstance(found, str):
            return DocumentRoute("skip", found)
        other = sorted(set(body) - _SAME_FIELDS - {"messages", "kvforge", "max_completion_tokens"})
        if other:
            return DocumentRoute("skip", f"{', '.join(other)} not served from a compressed document")
        try:
            text, question, system = split_context_question(body.get("messages"))
        except APIError as e:
            return DocumentRoute("skip", e.message)
        try:
            match = self.client(*found).match(text, question, system)
        except UserError as e:
            return DocumentRoute("skip", str(e))
        if match is None:
            return DocumentRoute("miss", "document not stored for this model, press and code")
        return DocumentRoute("hit", doc=match.doc, completion=self._completion(body, match))

    def _completion(self, body: dict[str, Any], match: Any) -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k in _SAME_FIELDS}
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is None and self.max_model_len is not None:  # a chat may fill the context; a completion stops at 16
            limit = self.max_model_len - len(match.prompt_ids)
        if limit is not None:
            out["max_tokens"] = limit
        return out | match.completion()

    # ------------------------------------------------------------------------------------------ store
    def store(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """``POST /v1/kv/documents`` (the body ``kvforge serve`` takes, prefix mode): compress and store each
        document, described for vLLM; blocks this thread (minutes on a CPU for long documents)."""
        from kvforge.serve.schemas import DocumentsRequest

        req = DocumentsRequest.model_validate(body)
        if req.mode != "prefix":
            raise UserError("the router stores documents in prefix mode (RAG chunks are kvforge serve's)")
        press = req.press or self.press
        if not press:
            raise UserError("storing a document for vLLM needs a press (press, or the router's --press)")
        ratio = self.compression_ratio if req.compression_ratio is None else req.compression_ratio
        client = self.client(press, ratio, req.quant or self.quant)
        with self._lock:
            if client.engine is None:
                if self.model_folder is None:
                    raise UserError("this router cannot load the served model to compress documents")
                engine = _load_engine(self.model_folder)
                if engine.model_id != client.model_id:
                    raise UserError(f"the weights in {self.model_folder} are not the served model's")
                self.base.engine = engine
                for other in self._clients.values():
                    other.engine = engine
            t0 = time.perf_counter()
            stored = client.add(list(req.documents), system=req.system)
        size = getattr(client.store, "stored_size", None)
        logger.info("route: stored %d documents in %.1f s", len(stored), time.perf_counter() - t0)
        return [
            {"id": doc.key, "object": "kv.document", "mode": "prefix", "tokens": doc.num_tokens,
             "kv_slots": doc.num_slots, "press": press, "compression_ratio": ratio,
             "quant": client.stored_quant,
             "stored_bytes": size(doc.key) if size is not None else None}
            for doc in stored
        ]  # fmt: skip


def _load_engine(folder: str) -> Any:
    from kvforge.engine import Engine
    from kvforge.model import load_model

    model, tokenizer = load_model(folder)
    return Engine(model, tokenizer)


# ---------------------------------------------------------------------------------------------- answers
def loaded(answer: dict[str, Any]) -> bool:
    """Whether the connector reports the document's KV loaded in a completion answer."""
    params = answer.get("kv_transfer_params")
    report = params.get(docs.PARAM) if isinstance(params, dict) else None
    return isinstance(report, dict) and report.get("loaded") is True


def chat_answer(answer: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/completions`` answer as a chat completion."""
    choices = [
        {"index": c.get("index", i), "message": {"role": "assistant", "content": c.get("text", "")},
         "logprobs": None, "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason")}
        for i, c in enumerate(answer.get("choices") or [])
    ]  # fmt: skip
    return {"id": "chatcmpl-" + str(answer.get("id", "")).removeprefix("cmpl-"), "object": "chat.completion",
            "created": answer.get("created", int(time.time())), "model": answer.get("model"), "choices": choices,
            "usage": answer.get("usage")}  # fmt: skip


async def chat_stream(lines: AsyncIterator[str]) -> AsyncIterator[bytes]:
    """A ``/v1/completions`` event stream as a chat completion stream (the first delta of each choice carries the
    assistant role; ``[DONE]`` and errors pass as they are)."""
    started: set[int] = set()
    async for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :].strip()
        if data == "[DONE]":
            yield b"data: [DONE]\n\n"
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            continue
        if "error" in chunk or not isinstance(chunk.get("choices"), list):
            if "usage" in chunk and not chunk.get("choices"):  # the usage chunk of include_usage
                chunk["object"] = "chat.completion.chunk"
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            continue
        choices = []
        for c in chunk["choices"]:
            index = c.get("index", 0)
            delta: dict[str, Any] = {"content": c.get("text", "")}
            if index not in started:
                started.add(index)
                delta = {"role": "assistant", **delta}
            choices.append({"index": index, "delta": delta, "logprobs": None, "finish_reason": c.get("finish_reason")})
        out = {"id": "chatcmpl-" + str(chunk.get("id", "")).removeprefix("cmpl-"), "object": "chat.completion.chunk",
               "created": chunk.get("created"), "model": chunk.get("model"), "choices": choices}  # fmt: skip
        if chunk.get("usage") is not None:
            out["usage"] = chunk["usage"]
        yield f"data: {json.dumps(out)}\n\n".encode()
