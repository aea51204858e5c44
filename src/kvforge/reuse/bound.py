"""The confidence bound behind ``--max-error``: a similarity threshold certified from observed wrong candidates.

Setting. A lookup finds a top-1 stored candidate at cosine similarity ``s``; the guards pass or refuse it. The
candidate is *wrong* when reusing its KV would not answer like a full prefill of the prompt asked (the agreement test
of :mod:`kvforge.reuse.verify`; in the shipped calibration, a pair labelled "not a paraphrase"). A policy with
threshold ``t`` serves the candidate when the guards pass and ``s >= t``. Its false-hit rate is

    F(t) = P(guards pass and S >= t | the candidate is wrong),

the share of wrong candidates that are served. Since ``P(served and wrong) = F(t) P(wrong) <= F(t)``, a bound on
``F`` also bounds the error rate over all lookups (vCache's guarantee).

Test. From ``n`` wrong candidates seen (i.i.d. draws of the wrong candidates future lookups meet), ``N(t)`` of which
pass the guards with ``s >= t``: under ``H_t: F(t) > delta``, ``N(t)`` is a binomial ``Bin(n, F(t))``, stochastically
larger than ``Bin(n, delta)``, so ``p(t) = P(Bin(n, delta) <= N(t))`` is a valid p-value. The thresholds are tested
in a fixed order, from 1.0 downwards in steps of 0.001, each at level ``alpha``, stopping at the first that is not
rejected (fixed-sequence testing: the family-wise error stays <= alpha without a multiplicity correction; Learn then
Test, Angelopoulos et al. 2021, arXiv:2110.01052). The lowest rejected threshold ``t*`` therefore has
``F(t*) <= delta`` with probability >= 1 - alpha. Any stricter rule (a higher per-entry threshold, a similarity
floor, more guards) serves a subset of what ``t*`` serves, so its false-hit rate is lower still.

Consequence: with fewer than ``log(alpha) / log(1 - delta)`` wrong candidates seen (299 at delta = 0.01,
alpha = 0.05) not even ``t = 1`` is certified, and nothing is served: a cold start is safe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

BINS = 1000  # similarity resolution of the statistics: 0.001
NEVER = -1  # the bin of a candidate the guards refused: never served, whatever the threshold


def binom_cdf(k: int, n: int, p: float) -> float:
    """``P(Bin(n, p) <= k)`` (exact sum of the terms; no SciPy needed)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_q, log_p = math.log1p(-p), math.log(p)
    total, log_term = 0.0, n * log_q  # the j = 0 term
    for j in range(k + 1):
        total += math.exp(log_term)
        log_term += math.log(n - j) - math.log(j + 1) + log_p - log_q  # term j + 1 from term j
    return min(total, 1.0)


def min_wrong_needed(max_error: float, alpha: float) -> int:
    """How many wrong candidates must be seen before any threshold can be certified."""
    return math.ceil(math.log(alpha) / math.log1p(-max_error))


def certify(wrong_bins: Iterable[int], max_error: float, alpha: float) -> float:
    """The lowest threshold (a multiple of 0.001) whose false-hit rate is <= ``max_error`` with confidence
    ``1 - alpha``, from the similarity bins of the wrong candidates seen (``NEVER`` for those the guards refused);
    ``math.inf`` when even 1.0 cannot be certified (too few wrong candidates seen)."""
    if not 0.0 < max_error < 1.0:
        raise ValueError(f"max_error must lie in (0, 1), got {max_error}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    per_bin = [0] * (BINS + 1)
    n = 0
    for b in wrong_bins:
        n += 1
        if b != NEVER:
            per_bin[min(max(b, 0), BINS)] += 1
    best = math.inf
    above = 0  # wrong candidates served at the threshold being tested
    for b in range(BINS, -1, -1):
        above += per_bin[b]
        if binom_cdf(above, n, max_error) > alpha:
            break
        best = b / BINS
    return best


def _bisect(is_below: Callable[[float], bool]) -> float:
    """The point in [0, 1] where ``is_below`` turns from True to False (60 halvings)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if is_below(mid) else (lo, mid)
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Exact two-sided ``1 - alpha`` confidence interval of a rate seen ``k`` times in ``n``."""
    if n == 0:
        return 0.0, 1.0
    # lower: P(Bin(n, p) >= k) = alpha / 2 (increasing in p); upper: P(Bin(n, p) <= k) = alpha / 2 (decreasing)
    lower = 0.0 if k == 0 else _bisect(lambda p: 1.0 - binom_cdf(k - 1, n, p) < alpha / 2)
    upper = 1.0 if k >= n else _bisect(lambda p: binom_cdf(k, n, p) > alpha / 2)
    return lower, upper


def to_bin(similarity: float) -> int:
    """The statistics' bin of a cosine similarity (0.001 wide, below 0 counted as 0)."""
    return min(max(math.floor(similarity * BINS + 1e-9), 0), BINS)
