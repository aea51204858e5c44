"""The one decision of semantic reuse: may the new prompt reuse the stored candidate's KV?

Every entry point decides with :meth:`Decider.decide`: ``kvforge generate --reuse semantic`` and the server (through
:meth:`SemanticReuse.plan <kvforge.reuse.semantic.SemanticReuse.plan>`), ``kvforge route`` (through
:meth:`SemanticReuse.lookup <kvforge.reuse.semantic.SemanticReuse.lookup>`) and the evaluation's pair rates
(:func:`kvforge.eval.semantic_report.pair_rates`).

A candidate (the index's nearest stored prompt) is served when

1. its cosine similarity reaches :data:`~kvforge.reuse.policy.POPULATION_FLOOR` (below it the verifier is not asked:
   nothing that far is a paraphrase, and such lookups are outside the statistics);
2. its *score* reaches the entry's threshold from the policy (:mod:`kvforge.reuse.policy`: certified from the shipped
   calibration and the verified lookups shared in the store, raised per entry by what the entry was verified wrong
   at). The score is the cosine similarity (the default) or, with ``verifier="default"``, the learned verifier's
   ``P(same)`` (:mod:`kvforge.reuse.verifier`; opt-in: on the evaluation pairs it does not yet serve more
   paraphrases than the guards, docs/reuse.md);
3. no guard of ``guards`` refuses it: every guard with the cosine; with the verifier :data:`VERIFIER_GUARDS` (what
   each adds: docs/reuse.md, "Ablation").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

from kvforge.reuse.guards import DEFAULT_GUARDS, check, check_names, failed
from kvforge.reuse.policy import (
    DEFAULT_MAX_ERROR,
    POPULATION_FLOOR,
    BoundedErrorPolicy,
    FixedThreshold,
    Policy,
    is_certified,
    shipped_prior,
)
from kvforge.reuse.stats import StatsView

VERIFIER_GUARDS = ("numbers", "negation", "marks")
VERIFIER_MIN_SCORE = 0.5  # the verifier's floor: below even odds nothing is served, whatever was certified


@dataclass(frozen=True)
class Decision:
    """A decision on one candidate: ``reason`` is None when it is served."""

    reason: str | None
    score: float  # what the threshold applies to: the verifier's P(same), or the cosine similarity
    threshold: float
    refused: frozenset[str]  # every guard of the decider's guards that refuses the pair

    @property
    def is_hit(self) -> bool:
        return self.reason is None


@dataclass
class Decider:
    """Policy + verifier + guards (see the module docstring)."""

    policy: Policy
    guards: tuple[str, ...]
    verifier: Any = None  # an AlignmentVerifier (score(query, donor) -> float, name) or None: the cosine decides

    def __post_init__(self) -> None:
        self.guards = check_names(self.guards)

    @property
    def scorer(self) -> str:
        """What the scores are (a verifier's name, or ``cosine``): statistics of different scorers never mix."""
        return "cosine" if self.verifier is None else str(self.verifier.name)

    def score(self, query: str, donor: str, similarity: float) -> float:
        if self.verifier is None:
            return similarity
        if similarity < POPULATION_FLOOR:
            return 0.0
        return float(self.verifier.score(query, donor))

    def decide(
        self, query: str, donor: str, similarity: float, entry_key: str = "", stats: StatsView | None = None
    ) -> Decision:
        """Whether ``query`` may reuse the KV stored for ``donor`` (entry ``entry_key``), found at cosine
        ``similarity``, given the shared statistics ``stats`` (None: the shipped calibration alone)."""
        refused = failed(query, donor, self.guards)
        threshold = self.policy.threshold_for(entry_key, self.guards, stats)
        if not is_certified(threshold):
            reason = "no score is certified yet (too few wrong candidates seen): miss until calibrated"
            return Decision(reason, math.nan, threshold, refused)
        if self.verifier is not None and similarity < POPULATION_FLOOR:
            return Decision(f"similarity {similarity:.3f} < {POPULATION_FLOOR}", 0.0, threshold, refused)
        score = self.score(query, donor, similarity)
        if score < threshold:
            what = "similarity" if self.verifier is None else "verifier score"
            return Decision(f"{what} {score:.3f} < threshold {threshold:.3f}", score, threshold, refused)
        if refused:
            return Decision(check(query, donor, [g for g in self.guards if g in refused]), score, threshold, refused)
        return Decision(None, score, threshold, refused)

    def describe(self) -> str:
        scorer = "cosine" if self.verifier is None else self.verifier.describe()
        return f"{self.policy.describe()}; score: {scorer}; guards: {', '.join(self.guards) or 'none'}"


def build_decider(
    embedder: Any,
    *,
    threshold: float | None = None,
    max_error: float | None = None,
    guards: Sequence[str] | None = None,
    verifier: Any = None,
    policy: Policy | None = None,
) -> Decider:
    """The decider every entry point builds from its options.

    Args:
        embedder: the index's embedder; its shipped verifier (``verifier="default"``) starts from its weights.
        threshold: a fixed minimum cosine similarity (the paper's rule; no verifier, every guard by default).
        max_error: the bounded policy's tolerated false-hit rate (default 0.01).
        guards: the guards (default: :data:`VERIFIER_GUARDS` with a verifier, every guard without one).
        verifier: None (the default: the cosine decides), ``"default"`` (the verifier shipped for the embedder,
            if any: opt-in, see docs/reuse.md for what it serves and refuses today) or a verifier object.
        policy: a ready policy instead of ``threshold``/``max_error``.
    """
    if threshold is not None and max_error is not None:
        raise ValueError("give a similarity threshold or a max error rate, not both")
    if threshold is not None or isinstance(policy, FixedThreshold):
        verifier = None
    elif verifier == "default":
        verifier = default_verifier(embedder)
    if policy is None:
        if threshold is not None:
            policy = FixedThreshold(threshold)
        else:
            name = verifier.name if verifier is not None else getattr(embedder, "name", None)
            prior = shipped_prior(name) if isinstance(name, str) else None
            delta = max_error if max_error is not None else DEFAULT_MAX_ERROR
            scored = {} if verifier is None else {"min_similarity": VERIFIER_MIN_SCORE, "population_floor": 0.0}
            policy = BoundedErrorPolicy(delta, prior=prior, **scored)  # type: ignore[arg-type]
    default_guards = VERIFIER_GUARDS if verifier is not None else DEFAULT_GUARDS
    return Decider(policy, tuple(default_guards if guards is None else guards), verifier)


def default_verifier(embedder: Any) -> Any:
    """The verifier shipped for ``embedder`` (MiniLM: the verifier starts from its weights), or None. One per
    process and MiniLM folder: its model is read-only and its scores depend on the texts only."""
    from kvforge.reuse.verifier import DEFAULT_VERIFIER, minilm_path, shipped_tensors

    if getattr(embedder, "name", None) != "all-minilm-l6-v2" or shipped_tensors(DEFAULT_VERIFIER) is None:
        return None
    return _shared_verifier(minilm_path(embedder), DEFAULT_VERIFIER)


@lru_cache(maxsize=4)
def _shared_verifier(path: str, name: str) -> Any:
    from kvforge.reuse.verifier import CrossVerifier

    return CrossVerifier(SimpleNamespace(path=path), name)
