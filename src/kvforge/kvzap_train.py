"""Train a KVzap scorer on the model's own KVzip+ replay scores (kvforge's, not a downloaded model).

For each window of training text (``window`` tokens, as a document in a chat turn, the way the evaluation and the
server put a document before a question): one prefill records every layer's attention input, one KVzip replay gives
every entry's KVzip+ score (:class:`~kvforge.presses.kvzip.KVzipPress` with ``value_aware=True``: max replay
attention x ``||V W_O||_1`` over its layer mean); the header and sinks (always kept, never scored) are left out.
The last window is held out: the regularisation is chosen on it and the model's quality on it is saved with the
model (``info["validation"]``: correlation with the replay's log-scores and the overlap of the entries each keeps at
25% under one global top-k).

- ``linear``: ridge regression per layer from the attention input and the entry's recency features
  (:func:`~kvforge.presses.kvzap.position_features`: its distance from the context's end) to the ``H_kv``
  log-scores, solved in closed form from accumulated normal equations (memory independent of the number of tokens).
- ``mlp``: per layer ``hidden -> 64 -> H_kv`` with SiLU, Adam on the mean squared error (inputs standardised, the
  standardisation folded into the first layer), on at most ``max_samples`` tokens per layer, fitted to what the
  linear model's recency term leaves (the MLP keeps that term).

The default text is the public-domain Moby-Dick excerpt shipped in ``kvforge/data`` (about 15k SmolLM2 tokens).
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvforge.engine import Engine
from kvforge.errors import UserError
from kvforge.paths import bundled_data_dir
from kvforge.presses.apply import CompressionSource
from kvforge.presses.kvzap import (
    KINDS,
    MLP_HIDDEN,
    NUM_POSITION_FEATURES,
    KVzapModel,
    KVzapScorer,
    model_path,
    position_features,
)
from kvforge.presses.kvzip import KVzipPress
from kvforge.presses.kvzip_heads import fingerprint_of
from kvforge.presses.layer import Needs

logger = logging.getLogger(__name__)
# Documents of 4096 tokens: KVzip replays in chunks of 2048 context tokens, so each training document shows the scores
# of more than one replay chunk and distances from the context's end up to 4096 (2048-token documents showed neither
# and ranked 4096-token contexts worse)
DEFAULT_WINDOW = 4096
QUESTION = "What is this text about?"  # only splits the prompt: the context part is what is scored
ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # ridge strength, relative to the mean feature variance


def auto_train_size() -> tuple[int, int | None]:
    """``(tokens per window, max windows)`` of the training :func:`ensure_trained` runs on a press's first use:
    ``$KVFORGE_KVZAP_WINDOW`` (default 4096) and ``$KVFORGE_KVZAP_WINDOWS`` (default: every window of the text)."""
    try:
        window = int(os.environ.get("KVFORGE_KVZAP_WINDOW") or DEFAULT_WINDOW)
        windows = os.environ.get("KVFORGE_KVZAP_WINDOWS")
        return window, int(windows) if windows else None
    except ValueError:
        raise UserError("KVFORGE_KVZAP_WINDOW and KVFORGE_KVZAP_WINDOWS must be whole numbers") from None


def default_texts() -> list[Path]:
    """The public-domain sample text shipped with kvforge."""
    return sorted((bundled_data_dir() / "haystack_gutenberg").glob("*.txt"))


def read_texts(files: Sequence[Path]) -> list[tuple[str, str]]:
    """``(name, text)`` of plain-text files, or of every line of JSONL files (its ``text`` or ``context`` field)."""
    out: list[tuple[str, str]] = []
    for path in files:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"training text not found: {path}")
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for i, line in enumerate(f):
                    if line.strip():
                        row = json.loads(line)
                        text = row.get("text") or row.get("context")
                        if not isinstance(text, str):
                            raise UserError(f"{path}:{i + 1}: no 'text' or 'context' string")
                        out.append((f"{path.name}:{i + 1}", text))
        else:
            out.append((path.name, path.read_text(encoding="utf-8")))
    return out


def text_windows(tokenizer: Any, texts: Sequence[tuple[str, str]], window: int) -> list[str]:
    """Each text cut into consecutive windows of ``window`` tokens (a last piece under half a window is dropped)."""
    out = []
    for _, text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for a in range(0, len(ids), window):
            piece = ids[a : a + window]
            if len(piece) >= window // 2 or (a == 0 and len(piece) >= 64):
                out.append(tokenizer.decode(piece))
    return out


@dataclass(eq=False)
class Recorder:
    """A :class:`~kvforge.presses.base.HiddenScorer` that scores nothing and keeps every layer's attention input."""

    key: str = "kvzap:record"
    hidden: dict[int, list[Tensor]] = field(default_factory=dict)

    def bind(self, model: Any, tokenizer: Any) -> None:
        self.hidden.clear()

    def __call__(self, layer_idx: int, hidden_states: Tensor) -> None:
        self.hidden.setdefault(layer_idx, []).append(hidden_states[0].float().cpu())

    def finish(self, layer_idx: int, scores: Tensor) -> Tensor:
        return scores


@torch.inference_mode()
def replay_targets(
    model: Any, tokenizer: Any, text: str, chunk_size: int | None = 512
) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
    """``{layer: (X (N, hidden), P (N, 4), Y (N, H_kv))}``: attention inputs, recency features and log KVzip+ scores
    of ``text``'s entries as a document (chat template header and sinks left out)."""
    engine = Engine(model, tokenizer, chunk_size=chunk_size)
    ctx_ids, _ = engine.encode_qa(text, QUESTION)
    recorder = Recorder()
    needs = Needs(reconstruction=True, scorers=(recorder,))
    source = CompressionSource(model, ctx_ids, engine.new_cache(), needs, chunk_size=chunk_size, tokenizer=tokenizer)
    target = KVzipPress(compression_ratio=0.5, value_aware=True)
    out = {}
    for ctx in source.contexts(target):
        layer = ctx.model_layer if ctx.model_layer is not None else ctx.layer_idx
        y = target.score(ctx)[0].cpu()  # (H_kv, S), inf where always kept; fitted on CPU beside the hidden states
        scored = torch.isfinite(y).all(dim=0)
        x = torch.cat(recorder.hidden[layer], dim=0)
        pos = position_features(y.shape[-1])
        out[layer] = (x[scored], pos[scored], y[:, scored].float().clamp_min(1e-12).log().T.contiguous())
    return out


class _Gram:
    """Normal equations of a ridge regression with an unpenalised intercept, accumulated in float64."""

    def __init__(self) -> None:
        self.xtx: Tensor | None = None
        self.xty: Tensor | None = None

    def add(self, x: Tensor, y: Tensor) -> None:
        xa = torch.cat([x.double(), x.new_ones(x.shape[0], 1, dtype=torch.float64)], dim=1)
        xtx, xty = xa.T @ xa, xa.T @ y.double()
        self.xtx = xtx if self.xtx is None else self.xtx + xtx
        self.xty = xty if self.xty is None else self.xty + xty

    def solve(self, alpha: float) -> tuple[Tensor, Tensor]:
        assert self.xtx is not None and self.xty is not None
        n = float(self.xtx[-1, -1])
        d = self.xtx.shape[0] - 1
        mean = self.xtx[-1, :-1] / n
        variance = (torch.diagonal(self.xtx)[:-1] / n - mean**2).mean().clamp_min(1e-12)
        penalty = torch.full((d + 1,), alpha * float(variance) * n, dtype=torch.float64)
        penalty[-1] = 0.0
        coef = torch.linalg.solve(self.xtx + torch.diag(penalty), self.xty)  # (d + 1, H_kv)
        return coef[:-1].T.float().contiguous(), coef[-1].float().contiguous()


def _fit_mlp(x: Tensor, y: Tensor, epochs: int, seed: int) -> dict[str, Tensor]:
    """A ``hidden -> 64 -> H_kv`` SiLU MLP on standardised inputs, the standardisation folded into ``w1``/``b1``."""
    generator = torch.Generator().manual_seed(seed)
    x = x.float()
    mean, std = x.mean(dim=0), x.std(dim=0).clamp_min(1e-6)
    xs = (x - mean) / std
    with torch.inference_mode(False), torch.enable_grad():
        first = torch.nn.Linear(x.shape[1], MLP_HIDDEN)
        second = torch.nn.Linear(MLP_HIDDEN, y.shape[1])
        torch.nn.init.normal_(first.weight, std=x.shape[1] ** -0.5, generator=generator)
        torch.nn.init.zeros_(first.bias)
        torch.nn.init.zeros_(second.weight)
        with torch.no_grad():
            second.bias.copy_(y.mean(dim=0))
        params = [*first.parameters(), *second.parameters()]
        opt = torch.optim.Adam(params, lr=3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
        xs_t, y_t = xs.clone(), y.float().clone()
        for _ in range(epochs):
            order = torch.randperm(xs_t.shape[0], generator=generator)
            for i in range(0, len(order), 256):
                idx = order[i : i + 256]
                loss = torch.nn.functional.mse_loss(second(torch.nn.functional.silu(first(xs_t[idx]))), y_t[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()
        w1 = first.weight.detach() / std
        b1 = first.bias.detach() - w1 @ mean
        w2, b2 = second.weight.detach().clone(), second.bias.detach().clone()
        return {"w1": w1.contiguous(), "b1": b1, "w2": w2, "b2": b2}


def _predict(model: KVzapModel, layer: int, x: Tensor, pos: Tensor) -> Tensor | None:
    """``(N, H_kv)`` the model's log-scores of entries with attention inputs ``x`` and recency features ``pos``."""
    got = model.predict(layer, x[None])
    if got is None:
        return None
    recency = model.recency(layer, pos)
    return got[0].T + (recency.T if recency is not None else 0.0)


def _validation(
    model: KVzapModel, held: dict[int, tuple[Tensor, Tensor, Tensor]], kept: float = 0.25
) -> dict[str, float]:
    """Correlation of predicted and replay log-scores over every (layer, head, token) of the held-out window, and the
    overlap of the entries each keeps at ``kept`` under one global top-k."""
    preds, targets = [], []
    for layer, (x, pos, y) in sorted(held.items()):
        got = _predict(model, layer, x, pos)
        if got is not None:
            preds.append(got.reshape(-1))
            targets.append(y.reshape(-1))
    p, t = torch.cat(preds), torch.cat(targets)
    k = max(1, int(kept * p.numel()))
    overlap = len(set(p.topk(k).indices.tolist()) & set(t.topk(k).indices.tolist())) / k
    corr = float(torch.corrcoef(torch.stack([p, t]))[0, 1])
    return {"corr": round(corr, 4), f"kept_overlap_{round(kept * 100)}": round(overlap, 4), "mse": round(float(
        (p - t).pow(2).mean()), 4)}  # fmt: skip


def train_kvzap(
    model: Any,
    tokenizer: Any,
    kind: str = "linear",
    files: Sequence[Path] | None = None,
    window: int = DEFAULT_WINDOW,
    max_windows: int | None = None,
    chunk_size: int | None = 512,
    epochs: int = 30,
    max_samples: int = 8192,
    seed: int = 0,
    progress: str | None = None,
) -> KVzapModel:
    """Train a KVzap scorer of ``kind`` for ``model`` on ``files`` (default: the bundled sample text).

    Args:
        window: tokens of text per training document; the last window is held out for validation.
        max_windows: use at most this many windows (the held-out one included).
        max_samples: MLP only: tokens per layer it trains on (a random subset).
        progress: show a progress bar of the replays on stderr with this title (None: no bar).
    """
    if kind not in KINDS:
        raise UserError(f"KVzap kind must be one of {', '.join(KINDS)}, got {kind!r}")
    texts = read_texts(list(files) if files else default_texts())
    windows = text_windows(tokenizer, texts, window)[:max_windows]
    if len(windows) < 2:
        raise UserError(f"KVzap training needs at least 2 windows of {window} tokens of text (got {len(windows)})")
    start, cpu_start = time.perf_counter(), time.process_time()
    data = _replays(model, tokenizer, windows, kind == "mlp", max(1, max_samples // (len(windows) - 1)), chunk_size,
                    seed, progress)  # fmt: skip
    replay_s = time.perf_counter() - start
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_layers, fingerprint = int(config.num_hidden_layers), fingerprint_of(model, tokenizer)
    alpha, linear = _fit_linear(data, num_layers, fingerprint)
    result = linear
    if kind == "mlp":
        layers: list[dict[str, Tensor] | None] = [None] * num_layers
        for layer, parts in data.samples.items():
            x = torch.cat([p[0] for p in parts]).float()
            # the MLP learns what the linear model's recency term leaves, and keeps that term
            y = torch.cat([p[2] - linear.recency(layer, p[1]).T for p in parts])  # type: ignore[union-attr]
            layers[layer] = {**_fit_mlp(x, y, epochs, seed + layer), "wp": linear.layers[layer]["wp"]}  # type: ignore[index]
        result = KVzapModel("mlp", fingerprint, layers)
    result.info = {
        "texts": [name for name, _ in texts][:20],
        "windows": len(windows) - 1,
        "window_tokens": window,
        "train_tokens": data.num_tokens,
        "held_out_tokens": next(iter(data.held.values()))[0].shape[0] if data.held else 0,
        "ridge_alpha": alpha,
        "epochs": epochs if kind == "mlp" else None,
        "seconds": {"replay": round(replay_s, 1), "fit": round(time.perf_counter() - start - replay_s, 1),
                    "cpu": round(time.process_time() - cpu_start, 1), "threads": torch.get_num_threads()},
        "validation": _validation(result, data.held),
        "linear_validation": _validation(linear, data.held) if kind == "mlp" else None,
    }  # fmt: skip
    linear.info = {**result.info, "validation": result.info["linear_validation"] or result.info["validation"],
                   "linear_validation": None, "epochs": None}  # fmt: skip
    result.linear = linear  # type: ignore[attr-defined]  # the MLP's training also fits the linear model
    logger.info("KVzap %s trained on %d tokens in %.0f s: %s", kind, data.num_tokens, time.perf_counter() - start,
                result.info["validation"])  # fmt: skip
    return result


@dataclass
class _Replays:
    """What the training windows' replays give: normal equations per layer, MLP samples, the held-out window."""

    grams: dict[int, _Gram] = field(default_factory=dict)
    samples: dict[int, list[tuple[Tensor, Tensor, Tensor]]] = field(default_factory=dict)
    held: dict[int, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)
    num_tokens: int = 0


def _replays(model: Any, tokenizer: Any, windows: list[str], keep_samples: bool, per_window: int,
             chunk_size: int | None, seed: int, progress: str | None) -> _Replays:  # fmt: skip
    """Replay every window; all but the last feed the regressions, the last is held out."""
    rng, out = random.Random(seed), _Replays()
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(windows), desc=progress, unit="doc", file=sys.stderr)
    for i, text in enumerate(windows):
        targets = replay_targets(model, tokenizer, text, chunk_size)
        if i == len(windows) - 1:
            out.held = targets
        else:
            for layer, (x, pos, y) in targets.items():
                out.grams.setdefault(layer, _Gram()).add(torch.cat([x, pos], dim=1), y)
                if keep_samples:
                    pick = sorted(rng.sample(range(x.shape[0]), min(per_window, x.shape[0])))
                    out.samples.setdefault(layer, []).append((x[pick].half(), pos[pick], y[pick]))
            out.num_tokens += next(iter(targets.values()))[0].shape[0]
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out


def _fit_linear(data: _Replays, num_layers: int, fingerprint: str) -> tuple[float, KVzapModel]:
    """The ridge model whose strength gives the least error on the held-out window: ``(alpha, model)``."""
    best: tuple[float, float, KVzapModel] | None = None
    for alpha in ALPHAS:
        layers: list[dict[str, Tensor] | None] = [None] * num_layers
        for layer, gram in data.grams.items():
            w, b = gram.solve(alpha)  # w: (H_kv, hidden + 4)
            hidden = w.shape[1] - NUM_POSITION_FEATURES
            layers[layer] = {"w1": w[:, :hidden].contiguous(), "b1": b, "wp": w[:, hidden:].contiguous()}
        candidate = KVzapModel("linear", fingerprint, layers)
        mse = _validation(candidate, data.held)["mse"]
        if best is None or mse < best[0]:
            best = (mse, alpha, candidate)
    assert best is not None
    return best[1], best[2]


def ensure_trained(press: Any, model: Any, tokenizer: Any) -> None:
    """Train and save, once per model, the KVzap scorer ``press`` (or a press it wraps) needs and has no file for:
    the explicit first-use step the CLI, the evaluation and the server's start-up take before prefilling with it."""
    for scorer in press.needs().scorers if press is not None else ():
        if not isinstance(scorer, KVzapScorer) or scorer.path:
            continue
        if tokenizer is None:
            raise UserError("KVzap trains its scorer on text: pass the model's tokenizer, or KVzapPress(model=FILE)")
        path = model_path(fingerprint_of(model, tokenizer), scorer.kind)
        if path.exists():
            continue
        logger.warning(
            "KVzap: no %s scorer for this model yet: training one on the bundled sample text (once, minutes on a "
            "CPU; `kvforge presses train` does it ahead), saving %s", scorer.kind, path
        )  # fmt: skip
        window, windows = auto_train_size()
        trained = train_kvzap(model, tokenizer, kind=scorer.kind, window=window, max_windows=windows,
                              progress="KVzap training (first use)")  # fmt: skip
        trained.save(path)
