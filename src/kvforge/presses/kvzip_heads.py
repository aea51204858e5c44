"""KVzip's context-independent head-level mode (Kim et al., 2025, arXiv 2505.23416, section "head-level eviction").

One calibration pass per model runs KVzip's context replay on a calibration prompt and keeps one importance score per
(layer, KV head): the mean over the context entries (sinks excluded) of the max attention they received while the
model repeated the context. Heads that reach far into the context score high; heads that only look at sinks and
recent tokens score low. The scores are saved as a small JSON file keyed by the model fingerprint
(:func:`kvforge.model.model_fingerprint`) under ``<kvforge cache dir>/kvzip-heads/`` and reused for every later
prompt with no replay: compression then costs a sort per layer (the issue's bar: <= 5% of the prefill).

At compression, a layer's budget (``H_kv * num_kept``, exact) is shared among its heads in proportion to their
calibrated scores (largest remainder, at least ``keep_first + 1`` each, at most S); each head keeps its first
``keep_first`` entries (sinks) and its most recent ones (a StreamingLLM window per head of calibrated length).
Departure: the paper keeps whole heads or streams them (DuoAttention-style, two lengths); proportional lengths give
the exact budget at every ratio. A calibration file made for another model fingerprint is refused.
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
from kvforge.presses.base import Press
from kvforge.presses.layer import LayerContext, Selection, check_ratio, num_kept

logger = logging.getLogger(__name__)
FORMAT = "kvforge-kvzip-heads/1"


def calibration_path(fingerprint: str, folder: Path | None = None) -> Path:
    """Where the head scores of the model with ``fingerprint`` live."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", fingerprint)
    return (folder if folder is not None else cache_dir() / "kvzip-heads") / f"{safe}.json"


def save_head_scores(path: Path, fingerprint: str, scores: list[list[float] | None]) -> None:
    """Write atomically (temp file + rename): a killed writer never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"format": FORMAT, "fingerprint": fingerprint, "scores": scores}))
    os.replace(tmp, path)


def load_head_scores(path: Path, fingerprint: str) -> list[list[float] | None]:
    """Head scores ``[layer][kv head]`` (None = layer not compressed) from ``path``, made for ``fingerprint``.

    Raises:
        UserError: unreadable or foreign file, or one calibrated for another model.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read KVzip head calibration {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("scores"), list):
        raise UserError(f"{path} is not a KVzip head calibration file ({FORMAT})")
    if data.get("fingerprint") != fingerprint:
        raise UserError(
            f"KVzip head calibration {path} was made for model {data.get('fingerprint')!r}, not {fingerprint!r}; "
            "calibrate this model (delete the file or pass another calibration path)"
        )
    return data["scores"]


def proportional_budgets(weights: Tensor, total: int, low: int, high: int) -> Tensor:
    """Integer budgets ``(H,)`` summing to ``total``, each in ``[low, high]``, proportional to ``weights`` above low."""
    h = weights.shape[0]
    low, total = min(low, high), min(total, h * high)
    budgets = torch.full((h,), low, dtype=torch.long)
    spare = total - h * low
    w = weights.double().clamp_min(0) + 1e-12
    while spare > 0:
        room = (high - budgets).clamp_min(0)
        open_ = room > 0
        share = torch.where(open_, w, torch.zeros_like(w))
        raw = share / share.sum() * spare
        add = torch.minimum(raw.floor().long(), room)
        if int(add.sum()) == 0:  # largest remainders, one each
            order = (raw - raw.floor()).masked_fill(~open_, -1).argsort(descending=True)
            add = torch.zeros_like(budgets)
            add[order[: min(spare, int(open_.sum()))]] = 1
        budgets += add
        spare -= int(add.sum())
    return budgets


def fingerprint_of(model: Any, tokenizer: Any) -> str:
    """The model fingerprint that keys per-model calibration files (a model without tokenizer: its weights only)."""
    from kvforge.model import model_fingerprint, weights_digest

    if tokenizer is not None:
        return model_fingerprint(model, tokenizer)
    return f"{type(model).__name__}:{weights_digest(model)[:16]}:no-tokenizer"


@dataclass
class KVzipHeadPress(Press):
    """Head-level KVzip: calibrated per-head budgets, sinks + recent window per head, no replay at run time."""

    compression_ratio: float = 0.0
    calibration: str | None = None  # a head-score file; None = the model's file in the kvforge cache dir
    keep_first: int = 4
    head_scores: list[list[float] | None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_ratio(self.compression_ratio)
        if self.keep_first < 0:
            raise ValueError(f"keep_first must be >= 0, got {self.keep_first}")

    def config(self) -> dict[str, object]:
        return {k: v for k, v in super().config().items() if k != "head_scores"}

    def needs_tokenizer(self) -> bool:
        return self.head_scores is None and not self.calibration  # calibrating replays the context once

    def prepare(self, source: Any) -> None:
        """Load the head scores of ``source``'s model (calibrating on its prompt and saving them the first time)."""
        if self.head_scores is not None:
            return
        fingerprint = fingerprint_of(source.model, source.tokenizer)
        path = Path(self.calibration) if self.calibration else calibration_path(fingerprint)
        if path.exists():
            self.head_scores = load_head_scores(path, fingerprint)
            return
        if self.calibration:
            raise UserError(f"KVzip head calibration {path} does not exist")
        logger.info("KVzip head-level: calibrating %s once (one context replay), saving %s", fingerprint, path)
        self.head_scores = source.calibrate_heads(self.keep_first)
        save_head_scores(path, fingerprint, self.head_scores)

    def compress(self, ctx: LayerContext) -> Selection:
        b, h_kv, s, _ = ctx.keys.shape
        n = num_kept(s, self.compression_ratio)
        if n >= s:
            return Selection(keep=torch.ones(b, h_kv, s, dtype=torch.bool, device=ctx.keys.device))
        layer = ctx.model_layer if ctx.model_layer is not None else ctx.layer_idx
        row = self.head_scores[layer] if self.head_scores is not None and layer < len(self.head_scores) else None
        if row is None or len(row) != h_kv:
            raise ValueError(f"KVzip head-level: no calibrated scores for layer {layer} with {h_kv} KV heads")
        budgets = proportional_budgets(torch.tensor(row), h_kv * n, min(self.keep_first + 1, n), s)
        ranks = torch.arange(s, device=ctx.keys.device)
        first = ranks < min(self.keep_first, int(budgets.min()))  # (S,)
        recent = ranks[None] >= (s - (budgets.to(ctx.keys.device)[:, None] - int(first.sum())))  # (H_kv, S)
        keep = (first[None] | recent)[None].expand(b, -1, -1).clone()
        return Selection(keep=keep)
