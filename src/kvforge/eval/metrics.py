"""Answer metrics (contains, contains_all, exact match, token F1, ROUGE-L) and the normalised score.

Text is normalised as in the official SQuAD script: lower case, punctuation and the articles a/an/the removed,
whitespace collapsed. Every metric returns a float in [0, 1] and, given several references, the best match
(``contains_all``: the fraction of references found, RULER's ``string_match_all``).
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def contains(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when some normalised reference occurs (as whole words) in the normalised prediction."""
    pred = f" {normalize_answer(prediction)} "
    return float(any(f" {normalize_answer(a)} " in pred for a in answers if normalize_answer(a)))


def contains_all(prediction: str, answers: Sequence[str]) -> float:
    """The fraction of references that occur (as whole words) in the prediction; RULER's multi-answer score."""
    refs = [a for a in answers if normalize_answer(a)]
    if not refs:
        return 0.0
    return sum(contains(prediction, [a]) for a in refs) / len(refs)


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals some normalised reference (no reference: an empty prediction)."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in (answers or [""])))


def _token_f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD token F1 against the best reference."""
    return max(_token_f1(prediction, a) for a in (answers or [""]))


@lru_cache(maxsize=1)
def _rouge_scorer() -> Any:
    try:
        from rouge_score import rouge_scorer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the rouge_l metric needs rouge-score: pip install 'kvforge[eval]'") from e
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, answers: Sequence[str]) -> float:
    """ROUGE-L F-measure (``rouge-score``, no stemming) against the best reference."""
    scorer = _rouge_scorer()
    return max(scorer.score(a, prediction)["rougeL"].fmeasure for a in (answers or [""]))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "contains": contains,
    "contains_all": contains_all,
    "em": exact_match,
    "f1": f1,
    "rouge_l": rouge_l,
}


def score_prediction(prediction: str, answers: Sequence[str], metric: str) -> float:
    """Score one prediction with the named metric (a value in [0, 1])."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(METRICS)}")
    return METRICS[metric](prediction, answers)


def normalized_score(score: float, full_score: float) -> float | None:
    """SurrogateKV's normalised score: ``100 * score / full_score`` on the same examples (None when full is 0)."""
    if full_score <= 0 or math.isnan(full_score) or math.isnan(score):
        return None
    return 100.0 * score / full_score
