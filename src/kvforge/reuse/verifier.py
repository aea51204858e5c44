"""A learned verifier of semantic candidates: does the stored prompt ask what the new one asks?

A sentence embedding cannot tell "flights from New York to Florida" from "flights from Florida to New York", nor
"the capital" from "the *urban* capital"; a candidate found by cosine similarity is therefore checked by a small model
over the token states of the same MiniLM that embeds the prompts (no second model). The two texts' word pieces are
aligned (cosine of their hidden states, layer by layer), and a pair becomes :data:`NUM_FEATURES` numbers:

* the sentence cosine;
* per layer (1-6), both directions: how well every piece finds a partner (min, mean, 10% and 25% quantiles of the
  best-partner similarity), how far the contextual state of a piece drifts from that of its identical partner
  (a word moved to another context: swapped roles, PAWS scrambles), and how often the best contextual partner is
  not the identical piece;
* pieces with no identical partner: their share on each side, how close they come to any piece of the other text
  (a synonym vs. another word), how many are numbers, negations or content pieces, and whether the counts of
  numbers and negations differ;
* word order: the share of adjacent identical pieces that stay adjacent, the share of inverted pairs, and how much
  each content piece's neighbours (two on each side) change;
* the length ratio and log total length.

A two-layer perceptron (``tanh``, 16 units) maps them to ``P(same question)``. It is trained on labelled pairs that
never include an evaluation or hold-out pair (``benchmarks/semantic_verifier.py``: the training part of the
calibration side of PAWS-Wiki and of the SQuAD paraphrases with their same-paragraph negatives, and part of the
written near-miss kinds) and shipped as ``kvforge/data/semantic/verifier-<name>.safetensors`` (a few KB, no pickle).
Its score is what the bounded policy thresholds (:mod:`kvforge.reuse.policy`): the shipped calibration of the
verifier counts its scores on the calibration pairs it was not trained on.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

VERIFIER_FORMAT = "kvforge-semantic-verifier-1"
DEFAULT_VERIFIER = "align-minilm-v1"
NUM_LAYERS = 6
TAIL_FEATURES = (  # after the cosine and the 13 per layer
    "lone_share_stored", "lone_share_asked", "lone_best_min", "lone_best_mean", "lone_numbers", "numbers_differ",
    "lone_negations", "negations_differ", "lone_content_stored", "lone_content_asked", "has_lone_content",
    "adjacency_kept", "inversions", "neighbour_change_max", "neighbour_change_mean", "neighbour_changes",
    "length_ratio", "log_length",
)  # fmt: skip
NUM_FEATURES = 1 + NUM_LAYERS * 13 + len(TAIL_FEATURES)
_NEGATION_WORDS = (
    "not no never none nobody nothing neither nor nowhere without cannot except unless hardly barely scarcely seldom "
    "rarely lack fail unable"
)
_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve twenty thirty forty fifty hundred thousand "
    "million billion first second third half twice"
)
_FUNCTION_WORDS = (
    "a an the of in on at to for by with from as and or but is are was were be been do does did what which who whom "
    "whose when where why how that this these those it its"
)
_NEGATIONS, _NUMBERS, _FUNCTION = (frozenset(w.split()) for w in (_NEGATION_WORDS, _NUMBER_WORDS, _FUNCTION_WORDS))


def feature_index(name: str) -> int:
    """The column of a feature of :data:`TAIL_FEATURES` (``cosine`` is column 0)."""
    return 0 if name == "cosine" else NUM_FEATURES - len(TAIL_FEATURES) + TAIL_FEATURES.index(name)


@dataclass(frozen=True)
class TokenStates:
    """One text as the verifier reads it: its word piece ids (no [CLS]/[SEP]) and unit hidden states of every layer.

    ``states``: ``(L + 1, S, D)`` float32, layer 0 the static piece embeddings."""

    ids: np.ndarray
    states: np.ndarray


@dataclass(frozen=True)
class PieceTables:
    """Per word piece of the vocabulary: whether it is a number, a negation, punctuation, a content piece."""

    is_number: np.ndarray
    is_negation: np.ndarray
    is_content: np.ndarray

    @classmethod
    def from_vocab(cls, pieces: Sequence[str]) -> PieceTables:
        words = [p.removeprefix("##") for p in pieces]
        is_number = np.array([any(c.isdigit() for c in w) or w in _NUMBERS for w in words])
        is_punct = np.array([bool(w) and all(not c.isalnum() for c in w) for w in words])
        is_negation = np.array([w in _NEGATIONS for w in words])
        is_content = ~is_punct & np.array([w not in _FUNCTION for w in words])
        return cls(is_number, is_negation, is_content)


def _quantiles(v: np.ndarray) -> list[float]:
    return [float(v.min()), float(v.mean()), float(np.quantile(v, 0.1)), float(np.quantile(v, 0.25))]


def _neighbours(ids: np.ndarray, i: int) -> set[tuple[int, int]]:
    return {(d, int(ids[i + d])) for d in (-2, -1, 1, 2) if 0 <= i + d < len(ids)}


def _order(a: np.ndarray, b: np.ndarray, same_a: np.ndarray, partner: np.ndarray, content: np.ndarray) -> list[float]:
    """Adjacency kept, inversions, and the change of each identical content piece's neighbours."""
    kept = [partner[i + 1] == partner[i] + 1 for i in range(len(a) - 1) if same_a[i] and same_a[i + 1]]
    matched = partner[same_a]
    n = len(matched)
    inversions = sum(int((matched[i + 1 :] < matched[i]).sum()) for i in range(n)) / (n * (n - 1) / 2) if n > 1 else 0
    changes = []
    for i in np.flatnonzero(same_a & content[a]):
        mine, theirs = _neighbours(a, i), _neighbours(b, int(partner[i]))
        changes.append(1.0 - len(mine & theirs) / max(len(mine | theirs), 1))
    change = np.array(changes or [0.0])
    return [float(np.mean(kept)) if kept else 1.0, float(inversions), float(change.max()), float(change.mean()),
            float((change > 0.5).sum())]  # fmt: skip


def pair_features(a: TokenStates, b: TokenStates, tables: PieceTables) -> np.ndarray:
    """The :data:`NUM_FEATURES` numbers the verifier reads for a pair (see the module docstring)."""
    if not len(a.ids) or not len(b.ids):
        return np.zeros(NUM_FEATURES, np.float32)
    a, b = TokenStates(a.ids, a.states.astype(np.float32)), TokenStates(b.ids, b.states.astype(np.float32))
    pooled_a, pooled_b = a.states[-1].mean(0), b.states[-1].mean(0)
    out = [float(pooled_a @ pooled_b / max(np.linalg.norm(pooled_a) * np.linalg.norm(pooled_b), 1e-9))]
    static = a.states[0] @ b.states[0].T  # (S_a, S_b)
    partner_a, partner_b = static.argmax(1), static.argmax(0)
    best_a, best_b = static.max(1), static.max(0)
    for layer in range(1, NUM_LAYERS + 1):
        sim = a.states[layer] @ b.states[layer].T
        out += _quantiles(sim.max(1)) + _quantiles(sim.max(0))
        drift = np.concatenate([best_a - sim[np.arange(len(a.ids)), partner_a],
                                best_b - sim[partner_b, np.arange(len(b.ids))]])  # fmt: skip
        out += [float(drift.max()), float(drift.mean()), float(np.quantile(drift, 0.9)),
                float((sim.argmax(1) != partner_a).mean()), float((sim.argmax(0) != partner_b).mean())]  # fmt: skip
    same_a, same_b = best_a > 0.99, best_b > 0.99
    lone_a, lone_b = a.ids[~same_a], b.ids[~same_b]
    lone_best = np.concatenate([best_a[~same_a], best_b[~same_b]])
    num_a, num_b = int(tables.is_number[a.ids].sum()), int(tables.is_number[b.ids].sum())
    neg_a, neg_b = int(tables.is_negation[a.ids].sum()), int(tables.is_negation[b.ids].sum())
    out += [1 - float(same_a.mean()), 1 - float(same_b.mean()),
            float(lone_best.min()) if len(lone_best) else 1.0, float(lone_best.mean()) if len(lone_best) else 1.0,
            int(tables.is_number[lone_a].sum() + tables.is_number[lone_b].sum()), float(num_a != num_b),
            int(tables.is_negation[lone_a].sum() + tables.is_negation[lone_b].sum()), float(neg_a != neg_b),
            int(tables.is_content[lone_a].sum()), int(tables.is_content[lone_b].sum()),
            float(np.concatenate([tables.is_content[lone_a], tables.is_content[lone_b]]).any())]  # fmt: skip
    out += _order(a.ids, b.ids, same_a, partner_a, tables.is_content)
    out += [min(len(a.ids), len(b.ids)) / max(len(a.ids), len(b.ids)), float(np.log(len(a.ids) + len(b.ids)))]
    return np.asarray(out, np.float32)


# ------------------------------------------------------------------------------------------------ model
@dataclass(frozen=True)
class VerifierWeights:
    """The perceptron: standardisation, one hidden ``tanh`` layer, a logit."""

    mean: np.ndarray  # (F,)
    scale: np.ndarray  # (F,)
    w1: np.ndarray  # (F, H)
    b1: np.ndarray  # (H,)
    w2: np.ndarray  # (H,)
    b2: np.ndarray  # ()
    meta: dict[str, str] = field(default_factory=dict)

    def probability(self, features: np.ndarray) -> np.ndarray:
        """``P(same)`` of ``(N, F)`` features."""
        hidden = np.tanh(((features - self.mean) / self.scale) @ self.w1 + self.b1)
        return np.asarray(1.0 / (1.0 + np.exp(-(hidden @ self.w2 + self.b2))), np.float64)

    def save(self, path: Path) -> None:
        from safetensors.numpy import save_file

        tensors = {k: np.ascontiguousarray(getattr(self, k), np.float32) for k in ("mean", "scale", "w1", "b1", "w2")}
        tensors["b2"] = np.asarray([self.b2], np.float32)
        save_file(tensors, str(path), metadata={"format": VERIFIER_FORMAT, **self.meta})

    @classmethod
    def load(cls, path: Path) -> VerifierWeights:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            if meta.get("format") != VERIFIER_FORMAT:
                raise ValueError(f"{path} is not a kvforge semantic verifier (format {meta.get('format')!r})")
            t = {k: f.get_tensor(k).astype(np.float64) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
        if t["mean"].shape != (NUM_FEATURES,):
            raise ValueError(f"{path}: {t['mean'].shape[0]} features, this kvforge computes {NUM_FEATURES}")
        return cls(t["mean"], t["scale"], t["w1"], t["b1"], t["w2"], float(t["b2"][0]), meta)


def fit_weights(features: np.ndarray, labels: np.ndarray, hidden: int = 16, weight_decay: float = 1e-2,
                seed: int = 0, max_iter: int = 300) -> VerifierWeights:  # fmt: skip
    """Fit the perceptron by L-BFGS on the logistic loss with an L2 penalty on the weights (deterministic: one
    thread, a fixed seed, full batch)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mean, scale = features.mean(0), features.std(0) + 1e-6
        x = torch.tensor((features - mean) / scale, dtype=torch.float64)
        y = torch.tensor(labels, dtype=torch.float64)
        gen = torch.Generator().manual_seed(seed)
        w1 = (torch.randn(x.shape[1], hidden, generator=gen, dtype=torch.float64) / x.shape[1] ** 0.5).requires_grad_()
        w2 = (torch.randn(hidden, generator=gen, dtype=torch.float64) / hidden**0.5).requires_grad_()
        b1 = torch.zeros(hidden, dtype=torch.float64, requires_grad=True)
        b2 = torch.zeros((), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([w1, b1, w2, b2], max_iter=max_iter, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            logits = torch.tanh(x @ w1 + b1) @ w2 + b2
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
            loss = loss + weight_decay * ((w1**2).sum() + (w2**2).sum())
            loss.backward()  # type: ignore[no-untyped-call]
            return loss

        opt.step(closure)  # type: ignore[no-untyped-call]
    finally:
        torch.set_num_threads(threads)
    d = {k: v.detach().numpy() for k, v in (("w1", w1), ("b1", b1), ("w2", w2))}
    return VerifierWeights(mean, scale, d["w1"], d["b1"], d["w2"], float(b2.detach()),
                           {"hidden": str(hidden), "weight_decay": str(weight_decay), "seed": str(seed)})  # fmt: skip


def verifier_path(name: str) -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "semantic" / f"verifier-{name}.safetensors"


@lru_cache(maxsize=4)
def shipped_weights(name: str) -> VerifierWeights | None:
    path = verifier_path(name)
    return VerifierWeights.load(path) if path.is_file() else None


# ------------------------------------------------------------------------------------------------ verifier
@dataclass
class AlignmentVerifier:
    """``score(query, donor)``: the probability that ``donor``'s stored KV answers ``query`` (see the module docstring).

    Args:
        embedder: the :class:`~kvforge.reuse.embedder.MiniLMEmbedder` whose token states are read.
        name: the shipped weights (``verifier-<name>.safetensors``) and the calibration (``prior-<name>.json``).
        weights: weights to use instead of the shipped ones (training, tests).
        cache_size: texts whose token states are kept (the stored prompts met again and again; a short prompt's
            take about 100 KB).
    """

    embedder: Any
    name: str = DEFAULT_VERIFIER
    weights: VerifierWeights | None = None
    cache_size: int = 512
    _states: OrderedDict[str, TokenStates] = field(default_factory=OrderedDict, init=False, repr=False)
    _tables: PieceTables | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.weights is None:
            self.weights = shipped_weights(self.name)

    def states(self, texts: Sequence[str]) -> list[TokenStates]:
        """Token states of ``texts`` (cached per text)."""
        todo = sorted({t for t in texts if t not in self._states})
        if todo:
            for text, (ids, states) in zip(todo, self.embedder.token_states(todo), strict=True):
                self._states[text] = TokenStates(ids, states.astype(np.float16))  # half the memory of a cached text
            while len(self._states) > self.cache_size:
                self._states.popitem(last=False)
        for t in texts:
            self._states.move_to_end(t)
        return [self._states[t] for t in texts]

    def tables(self) -> PieceTables:
        if self._tables is None:
            self._tables = PieceTables.from_vocab(self.embedder.vocabulary())
        return self._tables

    def features(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """``(N, F)`` features of ``(query, donor)`` pairs."""
        states = self.states([t for pair in pairs for t in pair])
        tables = self.tables()
        rows = [pair_features(states[2 * i + 1], states[2 * i], tables) for i in range(len(pairs))]
        return np.stack(rows) if rows else np.zeros((0, NUM_FEATURES), np.float32)

    def score_many(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """``P(same)`` of ``(query, donor)`` pairs."""
        if self.weights is None:
            raise ValueError(f"no verifier {self.name!r} is shipped ({verifier_path(self.name).name}) or given")
        return self.weights.probability(self.features(pairs))

    def score(self, query: str, donor: str) -> float:
        return float(self.score_many([(query, donor)])[0])

    def describe(self) -> str:
        meta = self.weights.meta if self.weights is not None else {}
        return f"verifier {self.name} ({json.dumps(meta, sort_keys=True)})"
