"""RAG strategies as trials of the evaluation runner (``kvforge.eval.runner``): one row kind per strategy x ratio.

A trial's ``prefill(engine, example)`` builds the prompt from ``example.chunks`` (or the whole context as one
chunk), precomputes and stores the chunks (not timed: "chunks already stored"), then times the strategy. The
recompute ratio goes in the runner's ratio slot (it keys the rows) and in ``info["recompute_ratio"]``.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from kvforge.rag.pipeline import RagModel
from kvforge.rag.strategies import RECOMPUTING, make_strategy

_RAG_MODELS: weakref.WeakKeyDictionary[Any, RagModel] = weakref.WeakKeyDictionary()


def rag_model_for(engine: Any) -> RagModel:
    """One :class:`RagModel` (and chunk store) per engine, shared by its trials (dropped with the engine)."""
    rag = _RAG_MODELS.get(engine)
    if rag is None or rag.model is not engine.model:
        rag = _RAG_MODELS[engine] = RagModel(engine.model, engine.tokenizer, model_id=engine.model_id)
    return rag


def rag_trial(strategy: str, recompute_ratio: float = 0.2, aux: RagModel | None = None, aux_name: str | None = None,
              **kwargs: Any) -> Any:
    """A :class:`kvforge.eval.runner.Trial` running RAG ``strategy`` (``full`` is the plain full prefill)."""
    from kvforge.eval.runner import Prefilled, Trial

    ratio = recompute_ratio if strategy in RECOMPUTING else 0.0
    if aux is not None:
        kwargs["aux"] = aux
    built = make_strategy(strategy, ratio if strategy in RECOMPUTING else None, **kwargs)
    method = strategy if aux_name is None else f"{strategy}:{aux_name}"

    def prefill(engine: Any, example: Any) -> Any:
        rag = rag_model_for(engine)
        docs = list(example.chunks) if example.chunks else [example.context]
        prompt = rag.build_prompt(docs, example.question, system=example.system, answer_prefix=example.answer_prefix)
        engine.check_length(len(prompt.ids()), example.max_new_tokens)
        built.warm(rag, prompt)
        start = time.perf_counter()
        result = rag.prefill(prompt, built)
        result.logits.argmax(-1).tolist()  # the first token
        ttft = time.perf_counter() - start
        info = {"strategy": strategy, "recompute_ratio": ratio, "num_reused": result.num_reused,
                "num_recomputed": result.num_recomputed, "num_fresh": result.num_fresh}
        prompt_ids = list(result.cache.token_ids)  # a copy: decoding extends the cache's list
        return Prefilled(result.cache, result.logits, ttft, prompt_ids, info)

    return Trial(method, ratio, prefill)


def rag_trials(strategies: list[str], ratios: list[float], aux: dict[str, RagModel] | None = None) -> list[Any]:
    """``full`` first, then every strategy (recomputing ones at every ratio, CacheClip also with each aux model)."""
    trials = [rag_trial("full")]
    for r in ratios:
        for s in strategies:
            if s == "full" or (s not in RECOMPUTING and r != ratios[0]):
                continue
            trials.append(rag_trial(s, r))
            if s == "cacheclip":
                trials += [rag_trial(s, r, aux=m, aux_name=n) for n, m in (aux or {}).items()]
    return trials
