"""Quality and TTFT of RAG strategies against full prefill: MuSiQue (10 passages) and a multi-document needle set.

Rows carry ``method`` (strategy name, ``cacheclip:<aux>`` for another auxiliary model), ``recompute_ratio``,
``score``, ``ttft_s``, and in the summary ``quality_vs_full`` and ``speedup_vs_full`` (median TTFT ratio, chunks
already stored: precompute is not timed).
"""

from __future__ import annotations

import json
import random
import re
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvforge.eval.metrics import contains, f1
from kvforge.rag.pipeline import RagModel, greedy_decode
from kvforge.rag.strategies import make_strategy

SYSTEM = "Answer the question using the documents. Reply with the answer only, in a few words."


@dataclass
class RagExample:
    id: str
    docs: list[str]
    question: str
    answers: list[str]
    metric: str = "f1"  # "f1" (token F1, best answer) | "contains" (an answer appears in the prediction)


@dataclass
class RagConfig:
    """One evaluated setting: a strategy name, its recompute ratio and (CacheClip) auxiliary model label."""

    strategy: str
    recompute_ratio: float | None = None
    aux_name: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return self.strategy if self.aux_name is None else f"{self.strategy}:{self.aux_name}"


def load_musique(path: Path, limit: int | None = None) -> list[RagExample]:
    """MuSiQue rows (``question``, ``answers``, ``ctxs``: 10 passages) as examples scored by token F1."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            docs = [(c["title"] + "\n" if c.get("title") else "") + c["text"] for c in row["ctxs"]]
            out.append(RagExample(row["id"], docs, row["question"], list(row["answers"]), "f1"))
            if limit is not None and len(out) >= limit:
                break
    return out


def make_needle_examples(
    essays_path: Path, num_examples: int, num_docs: int = 10, doc_chars: int = 2000, seed: int = 0
) -> list[RagExample]:
    """Multi-document needles: ``num_docs`` essay windows, one holding "The special magic number for X is N."."""
    with open(essays_path, encoding="utf-8") as f:
        essays = [json.loads(line)["text"] for line in f]
    text = re.sub(r"\s+", " ", " ".join(essays))
    rng = random.Random(seed)
    keys = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Dakar", "Hanoi", "Riga", "Accra", "Bern"]
    out = []
    for i in range(num_examples):
        start = rng.randrange(0, len(text) - num_docs * doc_chars)
        docs = [text[start + j * doc_chars : start + (j + 1) * doc_chars].strip() for j in range(num_docs)]
        key, value = rng.choice(keys), str(rng.randrange(1_000_000, 10_000_000))
        target = rng.randrange(num_docs)
        sentences = docs[target].split(". ")
        cut = rng.randrange(1, max(len(sentences), 2))
        sentences.insert(cut, f"The special magic number for {key} is {value}")
        docs[target] = ". ".join(sentences)
        out.append(RagExample(f"needle-{i:03d}", docs, f"What is the special magic number for {key}?", [value],
                              "contains"))
    return out


# one implementation of each metric: the evaluation harness's (SQuAD normalisation, whole-number matching)
token_f1 = f1
METRICS: dict[str, Callable[[str, list[str]], float]] = {"f1": f1, "contains": contains}


def build_strategy(config: RagConfig, aux_models: dict[str, RagModel]) -> Any:
    kwargs = dict(config.kwargs)
    if config.aux_name is not None:
        kwargs["aux"] = aux_models[config.aux_name]
    return make_strategy(config.strategy, config.recompute_ratio, **kwargs)


def evaluate(
    rag: RagModel,
    examples: list[RagExample],
    configs: list[RagConfig],
    aux_models: dict[str, RagModel] | None = None,
    max_new_tokens: int = 24,
    system: str | None = SYSTEM,
) -> Iterator[dict[str, Any]]:
    """Yield one row per (example, config); ``full`` is always run first as the reference."""
    aux_models = aux_models or {}
    configs = [RagConfig("full"), *[c for c in configs if c.strategy != "full"]]
    for ex in examples:
        prompt = rag.build_prompt(ex.docs, ex.question, system=system)
        for config in configs:
            strategy = build_strategy(config, aux_models)
            strategy.warm(rag, prompt)  # precompute and store chunks: not part of TTFT
            result = rag.prefill(prompt, strategy)
            ids = greedy_decode(rag.model, rag.tokenizer, result.cache, result.logits, max_new_tokens)
            prediction = rag.tokenizer.decode(ids, skip_special_tokens=True).strip()
            yield {
                "id": ex.id, "method": config.method, "strategy": config.strategy,
                "recompute_ratio": config.recompute_ratio if config.strategy in ("cacheblend", "cacheclip") else None,
                "score": METRICS[ex.metric](prediction, ex.answers), "ttft_s": result.ttft_s,
                "num_tokens": result.num_tokens, "num_context_tokens": prompt.num_context_tokens,
                "num_recomputed": result.num_recomputed, "prediction": prediction,
            }


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, ratio): mean score, quality normalised to full (on the same examples), median TTFT and speedup."""
    full = {r["id"]: r for r in rows if r["method"] == "full"}
    groups: dict[tuple[str, float | None], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["recompute_ratio"]), []).append(r)
    out = []
    for (method, ratio), rs in groups.items():
        score = statistics.mean(r["score"] for r in rs)
        both = [r for r in rs if r["id"] in full]  # quality is compared on the examples full also ran
        full_score = statistics.mean(full[r["id"]]["score"] for r in both) if both else 0.0
        own_score = statistics.mean(r["score"] for r in both) if both else 0.0
        speedups = [full[r["id"]]["ttft_s"] / r["ttft_s"] for r in rs if r["id"] in full and r["ttft_s"] > 0]
        n_ctx = sum(r["num_context_tokens"] for r in rs)
        out.append({
            "method": method, "recompute_ratio": ratio, "num_examples": len(rs), "score": score,
            "quality_vs_full": own_score / full_score if full_score else None,
            "ttft_s": statistics.median(r["ttft_s"] for r in rs),
            "speedup_vs_full": statistics.median(speedups) if speedups else None,
            "recomputed_share": sum(r["num_recomputed"] for r in rs) / n_ctx if method != "full" and n_ctx else 1.0,
            "mean_tokens": statistics.mean(r["num_tokens"] for r in rs),
        })
    return out


__all__ = ["RagConfig", "RagExample", "contains", "evaluate", "load_musique",
           "make_needle_examples", "summarize", "token_f1"]
