"""Semantic-reuse rows of ``kvforge eval --semantic``: the stored question's KV answers the question asked.

Per example (a ``stored_question`` and a ``question`` on one context; :mod:`kvforge.eval.tasks.semantic`): the
``full`` row prefills the question asked in full (the reference of every other row). Each semantic row first stores
the stored question's prompt (an engine request recorded by the strategy: its KV and index record, in a fresh
in-memory store per example, outside the clock), then runs the question asked as an engine request with one policy
(``default``: the bounded error rate at 0.01; ``max-error=X``; ``threshold=X``: a fixed threshold with the default
guards; ``paper``: the paper's fixed 0.7 without guards). A hit prefills the stored prompt's last token on its loaded
KV and decodes from there (the answer is to the stored question); a miss decodes from the full prefill of the
question asked. TTFT counts from the plan (embedding, search, store read) to the first token; a miss's TTFT is its
plan plus the full row's prefill of the same prompt (the same computation, not run twice). Rows carry the usual
columns plus ``hit``, ``similarity`` and ``reuse_reason``.

Offline verification is off in these rows: the policies use the shipped calibration only, so rows do not depend
on the order in which examples run.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from kvforge.cache import CacheSnapshot, KVCache
from kvforge.engine import Engine
from kvforge.eval.data import Example
from kvforge.eval.runner import FULL, Prefilled, Trial, document_of, prefill_request
from kvforge.request import Request
from kvforge.reuse.base import ChatContext, PromptContext, ReusePlan

PAPER_THRESHOLD = 0.7
DEFAULT_SPECS = ("default", "paper", "max-error=0.05", "threshold=0.9")


def check_spec(spec: str) -> dict[str, Any]:
    """The ``SemanticReuse`` options of a policy spec (``default``, ``verifier``: the shipped learned verifier,
    ``paper``, ``max-error=X``, ``threshold=X``)."""
    if spec == "default":
        return {}
    if spec == "paper":
        return {"threshold": PAPER_THRESHOLD, "guards": ()}
    if spec == "verifier":
        return {"verifier": "default"}
    name, sep, value = spec.partition("=")
    if sep and name in ("max-error", "threshold"):
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if name == "max-error" and 0.0 < number < 1.0:
            return {"max_error": number}
        if name == "threshold" and -1.0 <= number <= 1.0:
            return {"threshold": number}
        allowed = "(0, 1)" if name == "max-error" else "[-1, 1]"
        raise ValueError(f"semantic policy {spec!r}: {name} needs a number in {allowed}")
    choices = "default, verifier, paper, max-error=X, threshold=X"
    raise ValueError(f"unknown semantic policy {spec!r}; choose from {choices}")


def method_name(spec: str) -> str:
    return f"semantic:{spec}"


@dataclass
class _Memo:
    """The current example's full prefill (a miss decodes from it again) and its store."""

    example_id: str
    store: Any = None
    is_stored: bool = False
    full: tuple[KVCache, CacheSnapshot, Tensor, float] | None = None  # cache, its snapshot, logits, TTFT
    strategies: dict[str, Any] = field(default_factory=dict)


_MEMOS: weakref.WeakKeyDictionary[Any, _Memo] = weakref.WeakKeyDictionary()
_EMBEDDERS: dict[str, Any] = {}


def default_embedder() -> Any:
    """The embedder of the semantic rows and pair rates: MiniLM, loaded once per process."""
    if "minilm" not in _EMBEDDERS:
        from kvforge.reuse import MiniLMEmbedder

        _EMBEDDERS["minilm"] = MiniLMEmbedder()
    return _EMBEDDERS["minilm"]


def _memo(engine: Engine, example: Example) -> _Memo:
    memo = _MEMOS.get(engine)
    if memo is None or memo.example_id != example.id:  # one example at a time: memory stays bounded
        memo = _MEMOS[engine] = _Memo(example.id)
    return memo


def full_trial() -> Trial:
    """The question asked, prefilled in full; remembered so that a semantic miss decodes from the same prefill."""

    def prefill(engine: Engine, example: Example) -> Prefilled:
        request = Request(document_of(example), max_new_tokens=0, reuse=False)
        pre, _ = prefill_request(engine, request, example.max_new_tokens)
        _memo(engine, example).full = (pre.cache, CacheSnapshot(pre.cache), pre.logits, pre.ttft_s)
        return pre

    return Trial(FULL, 0.0, prefill)


@dataclass
class _OrFull:
    """The semantic strategy's plan, except that a miss takes the full row's prefill of the same prompt (the same
    computation, not run twice: its time is added to the row's TTFT). Records nothing."""

    reuse: Any
    memo: _Memo
    planned: ReusePlan | None = None

    def plan(
        self, token_ids: Seq[int], *, text: str | None = None, context: PromptContext | ChatContext | None = None
    ) -> ReusePlan:
        self.planned = plan = self.reuse.plan(token_ids, text=text, context=context)
        if plan.is_hit or self.memo.full is None:  # (resumed after the full row: the miss prefills again)
            return plan
        cache, snapshot, logits, _ = self.memo.full
        snapshot.restore()  # undo the tokens an earlier row decoded on it
        return ReusePlan(cache, len(token_ids), [], kind="given", logits=logits, reason=plan.reason,
                         info=plan.info)  # fmt: skip

    def record(self, token_ids: Seq[int], cache: KVCache, *, text: str | None = None, context: Any = None) -> None:
        """Nothing: the example's store holds the stored question only."""


def semantic_trial(spec: str, embedder: Any = None) -> Trial:
    """A row kind answering ``example.question`` with semantic reuse of ``example.stored_question``'s KV."""
    options = check_spec(spec)

    def strategy(engine: Engine, memo: _Memo) -> Any:
        from kvforge.reuse import SemanticReuse
        from kvforge.store import open_store

        if memo.store is None:
            memo.store = open_store("memory://")
        if spec not in memo.strategies:  # verify_ratio 0: rows do not depend on the order examples run in
            emb = embedder if embedder is not None else default_embedder()
            memo.strategies[spec] = SemanticReuse(memo.store, engine.model_id, emb, device=engine.model.device,
                                                  stats_refresh_s=0.0, verify_ratio=0.0, **options)  # fmt: skip
        return memo.strategies[spec]

    def prefill(engine: Engine, example: Example) -> Prefilled:
        if example.stored_question is None:
            raise ValueError(f"example {example.id} has no stored_question: semantic rows need one")
        memo = _memo(engine, example)
        reuse = strategy(engine, memo)
        if not memo.is_stored:  # the stored question's prompt: prefilled and recorded outside the clock
            stored = dataclasses.replace(example, question=example.stored_question)
            engine.run(Request(document_of(stored), max_new_tokens=0, reuse=reuse))
            memo.is_stored = True
        wrapper = _OrFull(reuse, memo)
        pre, seq = prefill_request(engine, Request(document_of(example), max_new_tokens=0, reuse=wrapper),
                                   example.max_new_tokens)  # fmt: skip
        plan = wrapper.planned
        assert plan is not None
        if not plan.is_hit and seq.plan.kind == "given" and memo.full is not None:
            pre.ttft_s += memo.full[3]  # the full row's prefill, which this miss would have run
        pre.prompt_ids = list(plan.token_ids) if plan.is_hit else list(seq.encoded.ids)
        pre.info = plan.summary()
        pre.columns = {
            "hit": plan.is_hit,
            "similarity": None if plan.similarity is None else round(float(plan.similarity), 4),
            "reuse_reason": plan.reason,
            "stored_question": example.stored_question,
        }
        return pre

    return Trial(method_name(spec), 0.0, prefill)


def semantic_trials(specs: Seq[str], embedder: Any = None) -> list[Trial]:
    """``full`` first, then one row kind per policy spec (specs checked now: a bad one fails before any model)."""
    return [full_trial()] + [semantic_trial(s, embedder) for s in specs]
