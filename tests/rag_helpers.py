"""RAG tests drive chunk reuse the way every caller does: a ``Request`` over chunks that the engine plans and steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from kvforge.cache import KVCache
from kvforge.engine import Engine
from kvforge.request import Chunks, Encoded, Request
from kvforge.reuse.rag import ChunkReuse, RagPrompt, make_strategy


@dataclass
class Prefilled:
    cache: KVCache
    logits: Tensor
    num_tokens: int
    num_reused: int
    num_recomputed: int
    num_fresh: int
    plan: Any


class RagRunner:
    """An engine and one chunk store shared by every method it runs (chunks computed once, as in real use)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.engine = Engine(model, tokenizer)
        self.reuse = ChunkReuse(model, tokenizer, model_id=self.engine.model_id)
        self.model, self.tokenizer = model, tokenizer

    @property
    def num_layers(self) -> int:
        return self.reuse.num_layers

    def build_prompt(self, docs: list[str], question: str, **kwargs: Any) -> RagPrompt:
        return self.reuse.build_prompt(docs, question, **kwargs)

    def load(self, prompt: RagPrompt, ape: bool = False) -> Any:
        return self.reuse.load(prompt, ape=ape)

    def prefill(self, prompt: RagPrompt, method: Any) -> Prefilled:
        self.reuse.method = make_strategy(method) if isinstance(method, str) else method
        chunks = Chunks(prompt.chunk_texts, prompt.question, prompt.system, prompt.separator)
        encoded = Encoded(prompt.ids(), prompt.question, prompt)  # the test's own pieces, tokenised already
        seq = self.engine.add(Request(chunks, max_new_tokens=0, reuse=self.reuse, encoded=encoded))
        self.engine.complete(seq)  # plan -> recompute -> (nothing to decode)
        plan, cache, logits = seq.plan, seq.cache, seq.logits
        if plan.kind == "miss":  # full: every prefix/chunk token computed
            n_cached = len(prompt.prefix_ids) + prompt.num_context_tokens
            return Prefilled(cache, logits, len(plan.token_ids), 0, n_cached, len(plan.token_ids) - n_cached, plan)
        return Prefilled(
            cache, logits, len(plan.token_ids), plan.reused_tokens, plan.recomputed_tokens, plan.fresh_tokens, plan
        )

    def run(self, prompt: RagPrompt, name: str, **kwargs: Any) -> Prefilled:
        return self.prefill(prompt, make_strategy(name, **kwargs))
