"""KVzap-style learned scorer (NVIDIA, arXiv 2601.07891): KVzip+ scores predicted from hidden states, no replay.

KVzip+ (:class:`~kvforge.presses.kvzip.KVzipPress` with ``value_aware=True``) scores every entry by the max attention
it receives while the model repeats the context, times its projected value contribution: the best query-agnostic
ranking kvforge has, at the price of a second pass over the context (~1.8-1.9x the prefill). KVzap replaces the
replay by a small model per layer that reads the layer's attention input (``hidden_states`` of the token, after the
input norm) and predicts the log KVzip+ score of the token's entry in each KV head: one ``(hidden, H_kv)`` linear
map (``kind="linear"``) or a 2-layer MLP with 64 hidden units (``kind="mlp"``). The predictions are computed by the
prefill's own hooks, chunk by chunk, so scoring costs a matmul per layer and chunk (under 1% of the prefill for the
linear model on SmolLM2-135M) and the selection is KVzip's: one top-k over every (layer, KV head, token), the chat
template header and the first ``keep_first`` entries always kept.

The model is trained by kvforge on the model's own replay scores (:mod:`kvforge.kvzap_train`, an explicit step
above the engine): on the public-domain sample text shipped with kvforge by default (or a user's files, ``kvforge
presses train``), once per model fingerprint, and saved as a small safetensors file under ``<kvforge cache
dir>/kvzap/`` (a file made for another model is refused). ``KVzapPress(model="path.safetensors")`` loads a
shipped file instead.

Departures from the paper: trained on kvforge's own KVzip+ scores (chunk-normalised replay x ``||V W_O||_1`` over
its layer mean) on a small sample, not on Nemotron pre-training data; used with a ratio (a fixed budget) and
KVzip's global top-k instead of a score threshold.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvforge.errors import UserError
from kvforge.paths import cache_dir
from kvforge.presses.base import ScorerPress
from kvforge.presses.kvzip import BudgetedSelection
from kvforge.presses.layer import LayerContext, Needs

logger = logging.getLogger(__name__)
FORMAT = "kvforge-kvzap/2"  # 2: layers may carry the recency weights ``wp``
OLD_FORMATS = ("kvforge-kvzap/1",)  # still read: no recency term
KINDS = ("linear", "mlp")
MLP_HIDDEN = 64
POSITION_SCALES = (64.0, 256.0, 1024.0)  # decay lengths of the recency features, in entries
NUM_POSITION_FEATURES = 1 + len(POSITION_SCALES)


def position_features(size: int, device: torch.device | None = None) -> Tensor:
    """``(size, NUM_POSITION_FEATURES)`` features of each entry's distance ``d`` from the last of ``size`` entries:
    ``log(1 + d)`` and ``exp(-d / s)`` for each of :data:`POSITION_SCALES`.

    KVzip's replay favours the end of the context (its repeat queries sit right after it), which a token's hidden
    state does not show; these let the learned model add a per-layer, per-head recency term at selection time, when
    the number of entries is known.
    """
    d = torch.arange(size - 1, -1, -1, device=device, dtype=torch.float32)
    return torch.stack([torch.log1p(d), *(torch.exp(-d / s) for s in POSITION_SCALES)], dim=1)


def model_path(fingerprint: str, kind: str, folder: Path | None = None) -> Path:
    """Where the trained scorer of ``kind`` for the model with ``fingerprint`` lives."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", fingerprint)
    # "-v2": a scorer trained on first use by an older kvforge (no recency term) is trained again, not reused
    return (folder if folder is not None else cache_dir() / "kvzap") / f"{safe}-{kind}-v2.safetensors"


@dataclass
class KVzapModel:
    """Per-layer predictors of log KVzip+ scores from a layer's attention input.

    Args:
        kind: ``"linear"`` (``w1`` ``(H_kv, hidden)``, ``b1`` ``(H_kv,)``) or ``"mlp"`` (``w1`` ``(64, hidden)``,
            ``b1``, then SiLU, ``w2`` ``(H_kv, 64)``, ``b2``); either may add ``wp`` ``(H_kv, 4)``, the weights of
            :func:`position_features` (a recency term added at selection time; files without it have none).
        fingerprint: the model these predict for (:func:`kvforge.model.model_fingerprint`).
        layers: per model layer, its parameters, or None for a layer that is not compressed (sliding window).
        info: how it was trained (texts, tokens, seconds, validation), saved with it.
    """

    kind: str
    fingerprint: str
    layers: list[dict[str, Tensor] | None]
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        self._on: dict[torch.device, list[dict[str, Tensor] | None]] = {}

    def predict(self, layer: int, hidden_states: Tensor) -> Tensor | None:
        """Log-score ``(B, H_kv, Q)`` of each token's entry from ``hidden_states`` ``(B, Q, hidden)``; None for a
        layer without a predictor."""
        params = self._params(hidden_states.device)
        p = params[layer] if layer < len(params) else None
        if p is None:
            return None
        x = hidden_states.float()
        y = torch.addmm(p["b1"], x.reshape(-1, x.shape[-1]), p["w1"].T)
        if self.kind == "mlp":
            y = torch.addmm(p["b2"], torch.nn.functional.silu(y), p["w2"].T)
        return y.view(*x.shape[:2], -1).transpose(1, 2)

    def position_term(self, layer: int, size: int, device: torch.device) -> Tensor | None:
        """``(H_kv, size)`` the recency part of the log-score of ``size`` new entries, or None (no ``wp``)."""
        return self.recency(layer, position_features(size, device))

    def recency(self, layer: int, features: Tensor) -> Tensor | None:
        """``(H_kv, N)`` the recency part of the log-score of entries with :func:`position_features` ``features``
        ``(N, 4)``, or None when layer ``layer`` has no ``wp``."""
        params = self._params(features.device)
        p = params[layer] if layer < len(params) else None
        if p is None or "wp" not in p:
            return None
        return p["wp"] @ features.T

    def _params(self, device: torch.device) -> list[dict[str, Tensor] | None]:
        if device not in self._on:
            self._on[device] = [
                None if p is None else {k: v.to(device=device, dtype=torch.float32) for k, v in p.items()}
                for p in self.layers
            ]
        return self._on[device]

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename) as safetensors; the kind, fingerprint and info in its metadata."""
        from safetensors.torch import save_file

        tensors = {f"{i}.{k}": v.contiguous() for i, p in enumerate(self.layers) if p is not None for k, v in p.items()}
        meta = {"format": FORMAT, "kind": self.kind, "fingerprint": self.fingerprint, "num_layers": len(self.layers),
                "info": self.info}  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata={"kvforge": json.dumps(meta)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, fingerprint: str | None = None) -> KVzapModel:
        """Read a file written by :meth:`save`; refuse one made for another model than ``fingerprint``.

        Raises:
            UserError: unreadable or foreign file, or one trained for another model.
        """
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {}).get("kvforge", "{}"))
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
        except Exception as exc:
            raise UserError(f"cannot read KVzap model {path}: {exc}") from None
        if meta.get("format") not in (FORMAT, *OLD_FORMATS) or meta.get("kind") not in KINDS:
            raise UserError(f"{path} is not a KVzap model file ({FORMAT})")
        if fingerprint is not None and meta.get("fingerprint") != fingerprint:
            raise UserError(
                f"KVzap model {path} was trained for model {meta.get('fingerprint')!r}, not {fingerprint!r}; train "
                "one for this model (kvforge presses train) or pass another file"
            )
        layers: list[dict[str, Tensor] | None] = [None] * int(meta["num_layers"])
        for name, t in tensors.items():
            i, key = name.split(".", 1)
            entry = layers[int(i)]
            if entry is None:
                entry = layers[int(i)] = {}
            entry[key] = t
        if not any(p is not None and "wp" in p for p in layers):
            logger.warning("KVzap model %s has no recency term (an older kvforge trained it): it ranks the end of long "
                           "contexts worse; `kvforge presses train --out FILE` makes a new one", path)  # fmt: skip
        return cls(meta["kind"], meta["fingerprint"], layers, meta.get("info") or {})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.layers if p is not None for t in p.values())


@dataclass(eq=False)
class KVzapScorer:
    """The :class:`~kvforge.presses.base.HiddenScorer` of :class:`KVzapPress`: binds the trained model of the model
    being prefilled (a file: training is a step of its own, :mod:`kvforge.kvzap_train`) and predicts per chunk."""

    kind: str = "linear"
    path: str | None = None
    model: KVzapModel | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        return f"kvzap:{self.kind}:{self.path or 'cache'}"

    def bind(self, model: Any, tokenizer: Any) -> None:
        from kvforge.presses.kvzip_heads import fingerprint_of

        fingerprint = fingerprint_of(model, tokenizer)
        if self.model is not None and self.model.fingerprint == fingerprint:
            return
        if self.path:
            path = Path(self.path)
            if not path.exists():
                raise UserError(f"KVzap model {path} does not exist")
            self.model = KVzapModel.load(path, fingerprint)
            return
        path = model_path(fingerprint, self.kind)
        if path.exists():
            self.model = KVzapModel.load(path, fingerprint)
            return
        raise UserError(
            f"KVzap has no trained {self.kind} scorer for {fingerprint}: train it once with `kvforge presses train "
            f"--kind {self.kind}` (the CLI, evaluation and server start-up do it for their press), "
            "kvforge.kvzap_train.ensure_trained(press, model, tokenizer), or give KVzapPress(model=FILE)"
        )

    def __call__(self, layer_idx: int, hidden_states: Tensor) -> Tensor | None:
        if self.model is None:
            raise RuntimeError("KVzap scorer used before bind()")
        return self.model.predict(layer_idx, hidden_states)

    def finish(self, layer_idx: int, scores: Tensor) -> Tensor:
        """The predictions of a layer's ``S`` new entries plus the model's recency term of their distance from the
        last one (files without it: the predictions alone)."""
        assert self.model is not None  # bound before the prefill that made ``scores``
        recency = self.model.position_term(layer_idx, scores.shape[-1], scores.device)
        return scores if recency is None else scores + recency[None].to(scores.dtype)


@dataclass
class KVzapPress(BudgetedSelection, ScorerPress):
    """Learned query-agnostic scores (KVzap), KVzip's selection: one top-k over the model, header and sinks kept.

    Args:
        kind: ``"linear"`` or ``"mlp"``.
        model: a trained file (``kvforge presses train --out``); None = this model's file in the kvforge cache dir
            (``kvforge presses train``, or the CLI's first use of the press).
        budget: ``"global"`` (KVzip's default), ``"layer"`` or ``"head"``, as :class:`KVzipPress`.
        keep_first, keep_header: entries always kept, as :class:`KVzipPress`.
        pool, whole_words: max over a window of neighbouring entries' / over a word's scores before the top-k, as
            :class:`KVzipPress`.
    """

    kind: str = "linear"
    model: str | None = None
    budget: str = "global"
    keep_first: int = 4
    keep_header: bool = True
    pool: int = 0
    whole_words: bool = False
    scorer: KVzapScorer = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        self.check_selection()
        if self.keep_first < 0:
            raise ValueError(f"keep_first must be >= 0, got {self.keep_first}")
        self.scorer = KVzapScorer(self.kind, self.model)

    def config(self) -> dict[str, object]:
        return {k: v for k, v in super().config().items() if k != "scorer"}

    def needs(self) -> Needs:
        return Needs(scorers=(self.scorer,), words=self.whole_words)

    def score(self, ctx: LayerContext) -> Tensor:
        got = (ctx.hidden_scores or {}).get(self.scorer.key)
        if got is None:
            raise ValueError("KVzap needs its scorer's scores from the prefill (run it through compress_prefill)")
        return self.pooled(got, ctx).masked_fill(ctx.protected(self.keep_first, self.keep_header)[:, None, :],
                                                 float("inf"))  # fmt: skip
