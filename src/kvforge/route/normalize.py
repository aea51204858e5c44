"""Semantic prompt normalisation (the seed paper's stack in front of vLLM): a request whose prompt is a paraphrase of
a stored one is rewritten to the stored prompt, so the engine behind sees an exact match and loads its KV.

What is matched: the last user message of a chat (the question), among stored prompts whose every other part is the
same (model, earlier messages, tools, chat template options: the request's *frame*, hashed into the index entry's
namespace); or the whole prompt of a completion. Matching is kvforge's semantic policy
(:class:`kvforge.reuse.semantic.SemanticReuse`: MiniLM cosine >= threshold, top-1 only, lexical guards on numbers,
negations, entities and word order), over the same index records in the same store as kvforge's own engine.

What is recorded: after an answered miss, the prompt's text is indexed under the store key of the last whole block
the vLLM connector saved for it (kvforge prefix-chain keys), once that block is in the store. A hit is only reported
while that block is still stored, so the rewrite always lands on stored KV.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvforge.reuse.base import digest
from kvforge.reuse.semantic import SemanticReuse

logger = logging.getLogger(__name__)

Endpoint = Literal["chat", "completions"]
# request fields that change the rendered prompt besides the matched text: part of the frame
FRAME_FIELDS = (
    "model", "tools", "tool_choice", "functions", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "documents", "add_special_tokens", "echo", "suffix", "response_format",
)  # fmt: skip


@dataclass
class RouteDecision:
    """What the router did with one request (reported to the client in the response's ``kvforge`` field)."""

    kind: Literal["hit", "exact", "miss", "skip"]
    endpoint: Endpoint | None = None
    query: str | None = None
    namespace: str | None = None
    similarity: float | None = None
    donor_prompt: str | None = None
    reason: str | None = None

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"route": self.kind}
        if self.similarity is not None:
            out["similarity"] = round(self.similarity, 4)
        if self.kind == "hit":
            out["approximate"] = True  # the answer is to the stored prompt, not to the words sent
            out["donor_prompt"] = self.donor_prompt
        if self.reason:
            out["reason"] = self.reason
        return out

    def header(self) -> str:
        extra = f"; similarity={self.similarity:.4f}" if self.similarity is not None else ""
        return f"{self.kind}{extra}"


def _text_of(content: Any) -> str | None:
    """A message's text: a string, or a list of text parts (anything else is not matched)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return None


class PromptNormalizer:
    """Decides, rewrites and records, for one served model.

    Args:
        semantic: the semantic strategy (index, policy) on the store the vLLM connector writes.
        block_keys: prompt token ids -> the store key of each of its blocks (the connector's prefix-chain keys).
        store_block_size: tokens per stored block.
        contains: whether the store holds a key.
    """

    def __init__(
        self,
        semantic: SemanticReuse,
        block_keys: Callable[[Sequence[int]], list[str]],
        store_block_size: int,
        contains: Callable[[str], bool],
    ) -> None:
        self.semantic = semantic
        self.block_keys = block_keys
        self.store_block_size = store_block_size
        self.contains = contains
        self._lock = threading.Lock()  # one index per process: lookups and records of concurrent requests take turns

    # ------------------------------------------------------------------------------------------ decide
    def frame(self, endpoint: Endpoint, body: dict[str, Any]) -> tuple[str, str] | str:
        """``(matched text, namespace)`` of a request, or why it is not matched."""
        fields = {k: body[k] for k in FRAME_FIELDS if k in body}
        if endpoint == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
                return "no messages"
            last = messages[-1]
            text = _text_of(last.get("content"))
            if last.get("role") != "user" or text is None or set(last) - {"role", "content"}:
                return "the last message is not a plain user message"
            frame = {"endpoint": endpoint, "messages": messages[:-1], **fields}
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                return "the prompt is not one string"
            frame = {"endpoint": endpoint, **fields}
        if not text.strip():
            return "empty prompt"
        return text, "route-v1-" + digest(json.dumps(frame, sort_keys=True, default=str))[:32]

    def decide(self, endpoint: Endpoint, body: dict[str, Any]) -> RouteDecision:
        """Look the request's prompt up under the semantic policy (no KV is read)."""
        opts = body.get("kvforge")
        if isinstance(opts, dict) and opts.get("route") is False:
            return RouteDecision("skip", endpoint, reason="kvforge.route is false")
        found = self.frame(endpoint, body)
        if isinstance(found, str):
            return RouteDecision("skip", endpoint, reason=found)
        query, namespace = found
        with self._lock:
            match = self.semantic.lookup(query, namespace)
        if isinstance(match, str):
            return RouteDecision("miss", endpoint, query, namespace, reason=match)
        similarity, entry = match
        kind: Literal["hit", "exact"] = "exact" if entry.text == query else "hit"
        return RouteDecision(kind, endpoint, query, namespace, similarity=similarity, donor_prompt=entry.text)

    # ------------------------------------------------------------------------------------------ rewrite
    @staticmethod
    def rewrite(body: dict[str, Any], decision: RouteDecision) -> dict[str, Any]:
        """The body to forward: the stored prompt in place of the paraphrase on a hit; kvforge's own field removed."""
        out = {k: v for k, v in body.items() if k != "kvforge"}
        if decision.kind != "hit" or decision.donor_prompt is None:
            return out
        if decision.endpoint == "chat":
            messages = [dict(m) for m in out["messages"]]
            messages[-1]["content"] = decision.donor_prompt
            out["messages"] = messages
        else:
            out["prompt"] = decision.donor_prompt
        return out

    @staticmethod
    def tokenize_body(body: dict[str, Any], decision: RouteDecision) -> dict[str, Any]:
        """The upstream ``/tokenize`` request that renders exactly the prompt ``body`` sent."""
        fields = {k: body[k] for k in FRAME_FIELDS if k in body and k not in ("echo", "suffix", "response_format")}
        if decision.endpoint == "chat":
            return {**fields, "messages": body["messages"]}
        return {**fields, "prompt": body["prompt"]}

    # ------------------------------------------------------------------------------------------ record
    def record_key(self, token_ids: Sequence[int]) -> str | None:
        """The store key of the last whole block of ``token_ids`` (None: shorter than one block)."""
        num_blocks = len(token_ids) // self.store_block_size
        return self.block_keys(list(token_ids))[num_blocks - 1] if num_blocks else None

    def record(self, decision: RouteDecision, token_ids: Sequence[int], wait_s: float = 10.0) -> str:
        """Index a missed prompt once the connector has stored its blocks; returns what happened (for logs)."""
        if decision.kind != "miss" or decision.query is None or decision.namespace is None:
            return "not a miss"
        key = self.record_key(token_ids)
        if key is None:
            return f"not recorded: {len(token_ids)} tokens, shorter than one stored block ({self.store_block_size})"
        deadline = time.monotonic() + wait_s
        while not self.contains(key):  # the connector writes blocks from a background thread
            if time.monotonic() > deadline:
                return f"not recorded: its blocks did not reach the store within {wait_s:g} s"
            time.sleep(0.05)
        with self._lock:
            self.semantic.index_text(key, decision.query, decision.namespace)
        return "recorded"
