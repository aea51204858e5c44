"""Answer F1 on SQuAD paraphrases: no reuse vs canonical semantic reuse vs context reuse, on a real model.

For each paragraph of a small ``squad_paraphrase`` subset the original question is asked first (stored), then its
paraphrase (should be answered well) and another question about the same paragraph (a hard negative: canonical
reuse at a low threshold answers the stored question instead). Canonical runs at the default threshold + guards and
at the paper's setting (threshold 0.7, no guards). One JSON line per condition.

    PYTHONPATH=src python benchmarks/semantic_f1.py --model smollm2-135m --num 24
"""

from __future__ import annotations

import argparse
import json
import re
import string
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvforge.paths import default_data_dir

RESULTS = Path(__file__).parent / "results"
SYSTEM = "Answer the question with a short phrase copied from the text."


def normalize(text: str) -> list[str]:
    """SQuAD answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def f1(prediction: str, answers: list[str]) -> float:
    best = 0.0
    for answer in answers:
        p, g = normalize(prediction), normalize(answer)
        common = sum((Counter(p) & Counter(g)).values())
        if common:
            precision, recall = common / len(p), common / len(g)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def select(rows: list[dict], num: int) -> list[dict]:
    """Rows (one per paragraph) with a paraphrase and a same-paragraph negative whose gold answer is known."""
    gold = {r["question"].lower(): r["answers"] for r in rows}
    out, seen = [], set()
    for r in rows:
        negatives = [n for n in r["negatives_same_context"] if n.lower() in gold and n.lower() != r["question"].lower()]
        if r["context"] in seen or not negatives or r["kind"] != "nonadversarial":
            continue
        seen.add(r["context"])
        out.append(r | {"negative": negatives[0], "negative_answers": gold[negatives[0].lower()]})
        if len(out) == num:
            break
    return out


def run_condition(engine: Any, reuse: Any, rows: list[dict], max_new_tokens: int) -> dict[str, Any]:
    """Ask the original (recorded), then the paraphrase and the negative; F1, hits and TTFT of the last two."""
    engine.reuse = reuse
    scores: dict[str, list[float]] = {"paraphrase": [], "negative": []}
    hits: dict[str, int] = {"paraphrase": 0, "negative": 0}
    ttft: list[float] = []
    for r in rows:
        if reuse is not None:
            engine.answer(r["context"], r["question"], system=SYSTEM, max_new_tokens=max_new_tokens, stop=["\n"])
        for kind, question, answers in (
            ("paraphrase", r["paraphrase"], r["answers"]),
            ("negative", r["negative"], r["negative_answers"]),
        ):
            gen = engine.answer(r["context"], question, system=SYSTEM, max_new_tokens=max_new_tokens, stop=["\n"])
            scores[kind].append(f1(gen.text, answers))
            hits[kind] += gen.reused_tokens > 0
            ttft.append(gen.ttft_s)
    engine.reuse = None
    n = len(rows)
    return {
        "paraphrase_f1": round(sum(scores["paraphrase"]) / n, 4),
        "negative_f1": round(sum(scores["negative"]) / n, 4),
        "paraphrase_reuse_rate": round(hits["paraphrase"] / n, 4),
        "negative_reuse_rate": round(hits["negative"] / n, 4),
        "mean_ttft_s": round(sum(ttft) / len(ttft), 4),
        "num_paragraphs": n,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num", type=int, default=24, help="paragraphs (each: original, paraphrase, negative)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=RESULTS / "semantic_f1.jsonl")
    args = parser.parse_args(argv)

    import torch

    from kvforge.engine import Engine
    from kvforge.model import load_model
    from kvforge.reuse import MiniLMEmbedder, SemanticReuse
    from kvforge.reuse.semantic import DEFAULT_THRESHOLD
    from kvforge.store import open_store

    rows = [
        json.loads(line) for line in ((args.data_dir or default_data_dir()) / "squad_paraphrase" / "pairs.jsonl").open()
    ]
    rows = select(rows, args.num)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device="cpu")
    engine = Engine(model, tokenizer)
    embedder = MiniLMEmbedder()
    conditions: dict[str, Any] = {
        "no_reuse": lambda: None,
        f"canonical_t{DEFAULT_THRESHOLD}_guards": lambda: SemanticReuse(
            open_store("memory://"), engine.model_id, embedder, mode="canonical"
        ),
        "canonical_t0.7_no_guards (paper)": lambda: SemanticReuse(
            open_store("memory://"), engine.model_id, embedder, mode="canonical", threshold=0.7, guards=()
        ),
        "context": lambda: SemanticReuse(open_store("memory://"), engine.model_id, embedder, mode="context"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for name, build in conditions.items():
            start = time.perf_counter()
            row = {"bench": "semantic_f1", "model": args.model, "condition": name}
            row |= run_condition(engine, build(), rows, args.max_new_tokens)
            row["elapsed_s"] = round(time.perf_counter() - start, 1)
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
