"""Semantic-reuse rows of ``kvforge eval --semantic``: the stored question's KV answers the question asked.

Per example (a ``stored_question`` and a ``question`` on one context; :mod:`kvforge.eval.tasks.semantic`): the
``full`` row prefills the question asked in full (the reference of every other row). Each semantic row first stores
the stored question's prompt (its KV and index record, in a fresh in-memory store per example, outside the clock),
then plans the question asked with one policy (``default``: the bounded error rate at 0.01; ``max-error=X``;
``threshold=X``: a fixed threshold with the default guards; ``paper``: the paper's fixed 0.7 without guards).
A hit prefills the stored prompt's last token on its loaded KV and decodes from there (the answer is to the stored
question); a miss decodes from the full prefill of the question asked. TTFT counts from the plan (embedding, search,
store read) to the first token; a miss's TTFT is its plan plus the full row's prefill of the same prompt (the same
computation, not run twice). Rows carry the usual columns plus ``hit``, ``similarity`` and ``reuse_reason``.

Offline verification is off in these rows: the policies use the shipped calibration only, so rows do not depend
on the order in which examples run.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvforge.eval.data import Example
from kvforge.eval.runner import FULL, Prefilled, Trial

PAPER_THRESHOLD = 0.7
DEFAULT_SPECS = ("default", "paper", "max-error=0.05", "threshold=0.9")


def check_spec(spec: str) -> dict[str, Any]:
    """The ``SemanticReuse`` options of a policy spec (``default``, ``paper``, ``max-error=X``, ``threshold=X``)."""
    if spec == "default":
        return {}
    if spec == "paper":
        return {"threshold": PAPER_THRESHOLD, "guards": ()}
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
    raise ValueError(f"unknown semantic policy {spec!r}; choose from default, paper, max-error=X, threshold=X")


def method_name(spec: str) -> str:
    return f"semantic:{spec}"


@dataclass
class _Memo:
    """The current example's full prefill (a miss decodes from it again) and its store."""

    example_id: str
    store: Any = None
    stored: bool = False
    full: tuple[Any, Any, Any, float, list[int]] | None = None  # cache, snapshot, logits, ttft, prompt ids
    strategies: dict[str, Any] = field(default_factory=dict)


_MEMOS: weakref.WeakKeyDictionary[Any, _Memo] = weakref.WeakKeyDictionary()
_EMBEDDERS: dict[str, Any] = {}


def default_embedder() -> Any:
    """The embedder of the semantic rows and pair rates: MiniLM, loaded once per process."""
    if "minilm" not in _EMBEDDERS:
        from kvforge.reuse import MiniLMEmbedder

        _EMBEDDERS["minilm"] = MiniLMEmbedder()
    return _EMBEDDERS["minilm"]


def _memo(engine: Any, example: Example) -> _Memo:
    memo = _MEMOS.get(engine)
    if memo is None or memo.example_id != example.id:  # one example at a time: memory stays bounded
        memo = _MEMOS[engine] = _Memo(example.id)
    return memo


def _encode(engine: Any, example: Example, question: str) -> tuple[list[int], list[int]]:
    ctx_ids, q_ids = engine.encode_qa(example.context, question, system=example.system,
                                      answer_prefix=example.answer_prefix)  # fmt: skip
    engine.check_length(len(ctx_ids) + len(q_ids), example.max_new_tokens)
    return list(ctx_ids), list(q_ids)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def full_trial() -> Trial:
    """The question asked, prefilled in full; remembered so that a semantic miss decodes from the same prefill."""

    def prefill(engine: Any, example: Example) -> Prefilled:
        from kvforge.cache import CacheSnapshot

        ctx_ids, q_ids = _encode(engine, example, example.question)
        _sync()
        start = time.perf_counter()
        cache, logits = engine.prefill(ctx_ids + q_ids)
        logits.argmax(-1).tolist()
        ttft = time.perf_counter() - start
        _memo(engine, example).full = (cache, CacheSnapshot(cache), logits, ttft, ctx_ids + q_ids)
        return Prefilled(cache, logits, ttft, ctx_ids + q_ids)

    return Trial(FULL, 0.0, prefill)


def semantic_trial(spec: str, embedder: Any = None) -> Trial:
    """A row kind answering ``example.question`` with semantic reuse of ``example.stored_question``'s KV."""
    options = check_spec(spec)

    def strategy(engine: Any, memo: _Memo) -> Any:
        from kvforge.reuse import SemanticReuse
        from kvforge.store import open_store

        if memo.store is None:
            memo.store = open_store("memory://")
        if spec not in memo.strategies:
            emb = embedder if embedder is not None else default_embedder()
            memo.strategies[spec] = SemanticReuse(memo.store, engine.model_id, emb, device=engine.model.device,
                                                  stats_refresh_s=0.0, **options)  # fmt: skip
        return memo.strategies[spec]

    def prefill(engine: Any, example: Example) -> Prefilled:
        from kvforge.reuse import PromptContext

        if example.stored_question is None:
            raise ValueError(f"example {example.id} has no stored_question: semantic rows need one")
        memo = _memo(engine, example)
        reuse = strategy(engine, memo)
        if not memo.stored:  # the stored question's prompt: prefilled and recorded outside the clock
            s_ctx, s_q = _encode(engine, example, example.stored_question)
            cache, _ = engine.prefill(s_ctx + s_q)
            reuse.record(s_ctx + s_q, cache, text=example.stored_question,
                         context=PromptContext(example.context, len(s_ctx)))  # fmt: skip
            memo.stored = True
        ctx_ids, q_ids = _encode(engine, example, example.question)
        ids = ctx_ids + q_ids
        _sync()
        start = time.perf_counter()
        plan = reuse.plan(ids, text=example.question, context=PromptContext(example.context, len(ctx_ids)))
        if plan.is_hit:
            cache, logits = engine.prefill(plan.prefill_ids, plan.cache)
            logits.argmax(-1).tolist()
            ttft, prompt_ids = time.perf_counter() - start, list(plan.token_ids)
        else:
            plan_s = time.perf_counter() - start
            if memo.full is None:  # resumed after the full row: prefill again
                cache, logits = engine.prefill(ids)
                logits.argmax(-1).tolist()
                ttft = time.perf_counter() - start
            else:
                cache, snapshot, logits, full_s, _ = memo.full
                snapshot.restore()  # undo the tokens an earlier row decoded on it
                ttft = plan_s + full_s
            prompt_ids = ids
        columns = {
            "hit": plan.is_hit,
            "similarity": None if plan.similarity is None else round(float(plan.similarity), 4),
            "reuse_reason": plan.info.get("reason"),
            "stored_question": example.stored_question,
        }
        return Prefilled(cache, logits, ttft, prompt_ids, info=plan.summary(), columns=columns)

    return Trial(method_name(spec), 0.0, prefill)


def semantic_trials(specs: Sequence[str], embedder: Any = None) -> list[Trial]:
    """``full`` first, then one row kind per policy spec (specs checked now: a bad one fails before any model)."""
    return [full_trial()] + [semantic_trial(s, embedder) for s in specs]
