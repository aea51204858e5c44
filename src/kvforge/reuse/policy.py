"""Hit-or-miss policies of semantic reuse: a fixed similarity threshold, or a bounded error rate (``--max-error``).

:class:`BoundedErrorPolicy` (the default, ``max_error=0.01``) serves a stored candidate when the guards pass and its
score (the learned verifier's ``P(same)``, or the cosine similarity where no verifier is used: "similarity" below
stands for either) reaches the entry's threshold::

    t_entry = max(t*, min_similarity, the highest score at which this entry was verified wrong + 0.001)

``t*`` is the lowest threshold whose false-hit rate (the share of wrong candidates served) is certified <= max_error
with confidence ``confidence`` (:mod:`kvforge.reuse.bound`), from the wrong candidates seen: the shipped calibration
(labelled pairs, ``kvforge/data/semantic/prior-*.json``, made by ``benchmarks/semantic_verifier.py`` for the
verifier and ``benchmarks/semantic_calibrate.py`` for the cosine) plus every
verified lookup of every process sharing the store (:mod:`kvforge.reuse.stats`); once the verified lookups alone hold
enough wrong candidates, their own certificate applies too and the stricter threshold wins. The per-entry term is
what the entry itself taught (vCache's per-entry threshold): a candidate verified wrong at similarity ``s`` is never
served again at ``s`` or below. Both only raise the threshold, so the bound still holds for what is served.

``min_similarity`` is a floor below which nothing is served (0.9 for the cosine: few wrong calibration pairs pass
every guard, so the certificate alone would reach far below what was ever observed; 0.5 for the verifier's score).
With no calibration for the embedder and no verified lookups, nothing is certified and every lookup is a miss.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from kvforge.reuse.bound import NEVER, certify, min_wrong_needed
from kvforge.reuse.stats import CountKey, StatsView

logger = logging.getLogger(__name__)

PRIOR_FORMAT = "kvforge-semantic-prior-1"
POPULATION_FLOOR = 0.5  # lookups whose best candidate is below this similarity are not in the statistics
DEFAULT_MAX_ERROR = 0.01
DEFAULT_MIN_SIMILARITY = 0.9


class Policy(Protocol):
    """Decides the similarity a candidate needs, per entry, given the shared statistics."""

    def threshold_for(self, entry_key: str, guards: Sequence[str], stats: StatsView | None) -> float: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class FixedThreshold:
    """The paper's rule: serve any candidate with cosine >= ``threshold`` (and the guards passing)."""

    threshold: float = 0.9

    def __post_init__(self) -> None:
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a cosine similarity in [-1, 1], got {self.threshold}")

    def threshold_for(self, entry_key: str, guards: Sequence[str], stats: StatsView | None) -> float:
        return self.threshold

    def describe(self) -> str:
        return f"fixed threshold {self.threshold:g}"


@dataclass(frozen=True)
class Prior:
    """Calibration counts shipped with kvforge for one embedder (wrong/right, refusing guards, similarity bin)."""

    embedder: str
    counts: dict[CountKey, int]
    source: str = ""

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Prior:
        if body.get("format") != PRIOR_FORMAT:
            raise ValueError(f"not a kvforge semantic prior (format {body.get('format')!r})")
        counts = {(int(w), str(g), int(b)): int(c) for w, g, b, c in body["counts"]}
        return cls(str(body["embedder"]), counts, str(body.get("source", "")))

    def to_json(self) -> dict[str, Any]:
        rows = [[w, g, b, c] for (w, g, b), c in sorted(self.counts.items())]
        return {"format": PRIOR_FORMAT, "embedder": self.embedder, "source": self.source, "counts": rows}


def prior_path(embedder: str) -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "semantic" / f"prior-{embedder}.json"


@lru_cache(maxsize=8)
def shipped_prior(embedder: str) -> Prior | None:
    """The calibration shipped for ``embedder`` (an embedder's ``name``), or None."""
    path = prior_path(embedder)
    if not path.is_file():
        return None
    return Prior.from_json(json.loads(path.read_text()))


def wrong_bins(counts: dict[CountKey, int], guards: Sequence[str], floor: float = POPULATION_FLOOR) -> list[int]:
    """The score bins of the wrong candidates in ``counts`` at or above ``floor``, ``NEVER`` for those one of
    ``guards`` refused."""
    active = set(guards)
    out: list[int] = []
    for (wrong, failed, b), c in counts.items():
        if not wrong or b < round(floor * 1000):
            continue  # not in the population the bound is about
        refused = bool(active & set(failed.split("+")) - {""})
        out += [NEVER if refused else b] * c
    return out


@dataclass
class BoundedErrorPolicy:
    """Serve a candidate only where the false-hit rate is certified <= ``max_error`` (see the module docstring).

    Args:
        max_error: delta, the tolerated share of wrong candidates served.
        confidence: 1 - alpha, the probability that the certificate holds.
        min_similarity: nothing scored below this is served.
        prior: calibration counts (None: none; the default is the shipped one of the strategy's scorer).
        population_floor: counts below this score are outside the population the bound is about (the cosine's
            floor; 0 for a verifier's score, whose population is chosen by cosine before it is scored).
    """

    max_error: float = DEFAULT_MAX_ERROR
    confidence: float = 0.95
    min_similarity: float = DEFAULT_MIN_SIMILARITY
    prior: Prior | None = None
    population_floor: float = POPULATION_FLOOR
    _cache: dict[Any, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.max_error < 1.0:
            raise ValueError(f"max_error is a rate in (0, 1), got {self.max_error}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must lie in (0, 1), got {self.confidence}")
        if not -1.0 <= self.min_similarity <= 1.0:
            raise ValueError(f"min_similarity is a cosine similarity in [-1, 1], got {self.min_similarity}")

    @property
    def alpha(self) -> float:
        return 1.0 - self.confidence

    def certified(self, guards: Sequence[str], stats: StatsView | None) -> float:
        """``t*``: the stricter of the certificates of (prior + verified lookups) and of the verified lookups alone
        once they hold enough wrong candidates; ``math.inf`` when nothing can be certified."""
        online = dict(stats.counts) if stats is not None else {}
        key = (tuple(sorted(guards)), tuple(sorted(online.items())))
        if key in self._cache:
            return self._cache[key]
        pooled = dict(self.prior.counts) if self.prior is not None else {}
        for k, c in online.items():
            pooled[k] = pooled.get(k, 0) + c
        t = certify(wrong_bins(pooled, guards, self.population_floor), self.max_error, self.alpha)
        own = wrong_bins(online, guards, self.population_floor)
        if len(own) >= min_wrong_needed(self.max_error, self.alpha):
            t = max(t, certify(own, self.max_error, self.alpha))
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[key] = t
        return t

    def threshold_for(self, entry_key: str, guards: Sequence[str], stats: StatsView | None) -> float:
        t = max(self.certified(guards, stats), self.min_similarity)
        active = set(guards)
        for obs in stats.entries.get(entry_key, []) if stats is not None else []:
            if obs.wrong and not active & (set(obs.failed.split("+")) - {""}):
                t = max(t, obs.similarity + 0.001)  # this entry answered wrong at this similarity: never again
        return t

    def describe(self) -> str:
        return f"max error {self.max_error:g} (confidence {self.confidence:g}, floor {self.min_similarity:g})"


def is_certified(t: float) -> bool:
    return not math.isinf(t)
