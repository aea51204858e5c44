"""Labelled prompt pairs for semantic reuse: calibration of the bounded policy and its false-hit rates, kept apart.

A pair is a stored prompt and a prompt asked later, labelled ``same`` (a paraphrase: reusing the stored prompt's KV
answers the question asked) or not. Sources:

* ``squad_paraphrase`` (shared data): a SQuAD question and its paraphrase (same); the question and another question
  about the same paragraph (not same).
* ``paws_wiki`` (shared data): PAWS-Wiki pairs, label 1 same, label 0 a scramble of almost the same words.
* ``near-miss`` (shipped with kvforge, ``kvforge/data/semantic/near_miss_dev.jsonl``): pairs written for kvforge,
  kinds of near-miss (IP addresses, versions, hex, exponents, encrypt/decrypt, pronouns, swapped subjects, numbers,
  units, dates, negations, opposites, ...) and true paraphrases.
* ``near-miss-holdout`` (``near_miss_holdout.jsonl``): twelve other kinds, written before the policy was designed
  and never used to calibrate anything. Its false hits (inserted qualifiers: "the *urban* population") led to the
  ``insertion`` guard, so it is no longer unseen.
* ``near-miss-holdout-2`` (``near_miss_holdout2.jsonl``): twelve more kinds, written after that and before the
  ``insertion`` guard, and evaluated once after it. Its false hits (``>`` / ``<``, ``-R`` / ``-r``, ``a[1:]`` /
  ``a[:1]``, ``¥`` / ``€``, ``spectacle`` / ``spectacles``) led to the ``marks`` and ``case`` guards and to plurals
  no longer folded, so it is no longer unseen either.
* ``near-miss-holdout-3`` (``near_miss_holdout3.jsonl``): ten more kinds, written before those changes and
  evaluated once after them. Its false hits (``./build`` / ``/build``, ``cd ..`` / ``cd .``, ``a?`` / ``a??``) came
  from ``marks`` dropping punctuation at both ends of a chunk; it now drops only quotes and one final stop.
* ``near-miss-holdout-4`` (``near_miss_holdout4.jsonl``): six more kinds, written before that change and evaluated
  once after it: the unseen hold-out.

Splits: every shared-data pair belongs to one side, ``calibration`` or ``evaluation``, by a hash of its group (the
SQuAD paragraph; the connected group of PAWS pairs sharing a sentence), so no paragraph or sentence is on both sides.
The shipped calibration is made from the calibration side and the written near-miss pairs only; every rate reported
as held out comes from the evaluation side or the hold-out pairs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.reuse.bound import clopper_pearson, to_bin
from kvforge.reuse.guards import GUARDS, failed
from kvforge.reuse.policy import POPULATION_FLOOR, Prior
from kvforge.reuse.stats import guard_key

logger = logging.getLogger(__name__)

BUNDLED = Path(__file__).resolve().parent.parent / "data" / "semantic"
SIDES = ("calibration", "evaluation")


@dataclass
class Pair:
    """A stored prompt and a prompt asked after it; ``same``: a paraphrase (the stored KV may answer it)."""

    stored: str
    asked: str
    same: bool
    source: str  # squad-paraphrase, squad-same-paragraph, paws, near-miss, near-miss-holdout(-2)
    kind: str = ""
    side: str = "calibration"
    similarity: float = float("nan")
    refused: frozenset[str] = frozenset()  # every guard of GUARDS that refuses the pair
    group: str = ""  # what keeps related pairs on one side (the SQuAD paragraph, the PAWS sentence group)
    score: float = float("nan")  # the learned verifier's P(same)


def side_of(group: str) -> str:
    """The side of a group (deterministic: the parity of its sha256)."""
    return SIDES[int(hashlib.sha256(group.encode()).hexdigest()[:8], 16) % 2]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def squad_pairs(path: Path) -> list[Pair]:
    """Paraphrases (same) and same-paragraph questions (not same) of ``squad_paraphrase/pairs.jsonl``."""
    out = []
    for r in _jsonl(path):
        side = side_of(r["context"])
        group = r["context"]
        out.append(Pair(r["question"], r["paraphrase"], True, "squad-paraphrase", r.get("kind", ""), side, group=group))
        for other in r.get("negatives_same_context", []):
            if other.strip().lower() != r["question"].strip().lower():
                out.append(Pair(r["question"], other, False, "squad-same-paragraph", "", side, group=group))
    return out


def paws_pairs(path: Path) -> list[Pair]:
    """PAWS-Wiki pairs; pairs sharing a sentence (transitively) stay on one side."""
    rows = _jsonl(path)
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for r in rows:
        parent[root(r["sentence1"])] = root(r["sentence2"])
    out = []
    for r in rows:
        group = root(r["sentence1"])
        out.append(Pair(r["sentence1"], r["sentence2"], bool(r["label"]), "paws", "", side_of(group), group=group))
    return out


NEAR_MISS_FILES = {  # source: (file, side)
    "near-miss": ("near_miss_dev.jsonl", "calibration"),
    "near-miss-holdout": ("near_miss_holdout.jsonl", "evaluation"),
    "near-miss-holdout-2": ("near_miss_holdout2.jsonl", "evaluation"),
    "near-miss-holdout-3": ("near_miss_holdout3.jsonl", "evaluation"),
    "near-miss-holdout-4": ("near_miss_holdout4.jsonl", "evaluation"),
}


def near_miss_pairs(source: str = "near-miss") -> list[Pair]:
    """The written near-miss pairs shipped with kvforge, of one ``source`` of :data:`NEAR_MISS_FILES`."""
    name, side = NEAR_MISS_FILES[source]
    return [Pair(r["stored"], r["asked"], bool(r["same"]), source, r["class"], side, group=f"{source}:{r['class']}")
            for r in _jsonl(BUNDLED / name)]


def load_pairs(data_dir: Path | None, include_holdout: bool = True) -> list[Pair]:
    """Every pair available: the shared data's when ``data_dir`` holds it (skipped with a warning otherwise), and
    the shipped near-miss pairs."""
    sources = [s for s in NEAR_MISS_FILES if include_holdout or s == "near-miss"]
    pairs = [p for source in sources for p in near_miss_pairs(source)]
    for folder, reader, file in (("squad_paraphrase", squad_pairs, "pairs.jsonl"), ("paws_wiki", paws_pairs,
                                                                                  "pairs.jsonl")):  # fmt: skip
        path = Path(data_dir) / folder / file if data_dir is not None else None
        if path is not None and path.is_file():
            pairs += reader(path)
        else:
            logger.warning("no %s/%s under %s: its pairs are skipped", folder, file, data_dir)
    return pairs


def score_pairs(pairs: list[Pair], embedder: Any, cache_dir: Path | None = None, batch: int = 512) -> list[Pair]:
    """Fill in each pair's cosine similarity (embedding every distinct text once; cached in ``cache_dir``) and the
    guards that refuse it."""
    texts = sorted({t for p in pairs for t in (p.stored, p.asked)})
    name = str(getattr(embedder, "name", type(embedder).__name__))
    tag = hashlib.sha256(("\n".join(texts) + name).encode()).hexdigest()[:16]
    path = cache_dir / f"embeddings-{name}-{tag}.npy" if cache_dir is not None else None
    if path is not None and path.is_file():
        vectors = np.load(path)
    else:
        vectors = np.concatenate([embedder.embed(texts[i : i + batch]) for i in range(0, len(texts), batch)] or
                                 [np.zeros((0, embedder.dim), np.float32)])  # fmt: skip
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, vectors)
    index = {t: i for i, t in enumerate(texts)}
    for p in pairs:
        p.similarity = float(vectors[index[p.stored]] @ vectors[index[p.asked]])
        p.refused = failed(p.asked, p.stored, tuple(GUARDS))
    return pairs


def calibrate(pairs: Iterable[Pair], scorer: str, source: str = "", score: bool = False) -> Prior:
    """The calibration counts of ``pairs`` (scored): a pair not ``same`` is a wrong candidate; binned by cosine
    similarity, or with ``score`` by the verifier's score (then only pairs whose similarity reaches the population
    floor, the lookups the verifier is asked about)."""
    counts: Counter[tuple[int, str, int]] = Counter()
    for p in pairs:
        if score and p.similarity < POPULATION_FLOOR:
            continue
        counts[(int(not p.same), guard_key(p.refused), to_bin(p.score if score else p.similarity))] += 1
    return Prior(scorer, dict(counts), source)


def rate(pairs: Sequence[Any], hit: Any) -> dict[str, Any]:
    """``hit`` rate over ``pairs`` with its exact 95% confidence interval."""
    k = sum(1 for p in pairs if hit(p))
    lo, hi = clopper_pearson(k, len(pairs))
    return {"hits": k, "n": len(pairs), "rate": k / len(pairs) if pairs else None, "ci95": [lo, hi]}
