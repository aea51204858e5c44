"""The press base classes: ``Press`` (``compress`` one layer, or ``compress_all`` for a model-wide budget),
``ScorerPress`` (scores in, top-k out), ``WindowPress`` and ``WrapperPress``. What a press sees and returns is in
:mod:`kvforge.presses.layer`; :mod:`kvforge.presses.apply` runs a press during a prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

from kvforge.cache import KVCache
from kvforge.hf import attach
from kvforge.prefill import DEFAULT_CHUNK_SIZE
from kvforge.presses.apply import compress_prefill
from kvforge.presses.layer import LayerContext, Needs, Selection, check_ratio, num_kept, topk_mask


@dataclass
class Press:
    """Base of every press: ``compress(ctx) -> Selection`` for one layer; ``needs()`` says what to collect."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def needs(self) -> Needs:
        return Needs()

    def compress(self, ctx: LayerContext) -> Selection:
        raise NotImplementedError

    def compress_all(self, contexts: list[LayerContext]) -> list[Selection]:
        """Selections for every compressed layer at once (a press with a model-wide budget overrides this)."""
        return [self.compress(ctx) for ctx in contexts]

    def __call__(
        self, model: Any, tokenizer: Any = None, chunk_size: int | None = DEFAULT_CHUNK_SIZE
    ) -> AbstractContextManager:
        """kvpress-style: ``with press(model): model.generate(input_ids)`` compresses the prompt, decodes on it.

        See :func:`kvforge.hf.attach` (``tokenizer``: for KVzip's replay request; ``chunk_size``: the prefill's).
        """
        return attach(model, self, tokenizer=tokenizer, chunk_size=chunk_size)

    def compress_prefill(
        self,
        model: Any,
        input_ids: Tensor | list[int],
        cache: KVCache,
        *,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        tokenizer: Any = None,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> Tensor:
        """Prefill ``input_ids`` on ``cache`` and compress the new entries with this press (see
        :func:`kvforge.presses.apply.compress_prefill`); the last token's logits."""
        return compress_prefill(model, input_ids, cache, self, chunk_size, tokenizer, on_chunk)

    def needs_tokenizer(self) -> bool:
        """Whether compressing needs the tokenizer (KVzip encodes its "repeat the context" request with it)."""
        return self.needs().reconstruction and getattr(self, "prompt_ids", None) is None

    def ratio(self) -> float:
        """The fraction of new entries removed per layer."""
        return float(getattr(self, "compression_ratio", 0.0))

    def config(self) -> dict[str, object]:
        """Hyperparameters as plain values (nested presses as dicts), for reports."""
        out: dict[str, object] = {"type": type(self).__name__}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.config() if isinstance(value, Press) else value
        if getattr(self, "kv_budget", None) is not None:  # a fixed budget instead of the ratio (build_press)
            out["kv_budget"] = self.kv_budget  # type: ignore[attr-defined]
        return out


@dataclass
class ScorerPress(Press):
    """A press that scores entries per KV head and keeps the top ``num_kept`` of every head."""

    compression_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_ratio(self.compression_ratio)

    def score(self, ctx: LayerContext) -> Tensor:
        """``(B, H_kv, S)`` importance of every new entry; higher = keep."""
        raise NotImplementedError

    def compress(self, ctx: LayerContext) -> Selection:
        n = num_kept(ctx.size, self.compression_ratio)
        if n >= ctx.size:
            return Selection.everything(ctx)
        return Selection(keep=topk_mask(self.score(ctx), n))


@dataclass
class WindowPress(ScorerPress):
    """A scorer press that reads the attention of the prompt's last ``window_size`` queries (and of ``lookahead``
    greedy draft tokens decoded with the full cache first)."""

    window_size: int = 64
    lookahead: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_size < 1 or self.lookahead < 0:
            raise ValueError(f"window_size must be >= 1 and lookahead >= 0, got {self.window_size}, {self.lookahead}")

    def needs(self) -> Needs:
        return Needs(window_size=self.window_size, lookahead=self.lookahead)


@dataclass
class WrapperPress(Press):
    """A press that changes how an inner scorer's scores are turned into a selection (AdaKV, CriticalKV)."""

    press: ScorerPress = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if not isinstance(self.press, ScorerPress):
            raise ValueError(f"{type(self).__name__} wraps a scorer press, got {type(self.press).__name__}")

    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio

    @compression_ratio.setter
    def compression_ratio(self, value: float) -> None:
        check_ratio(value)
        self.press.compression_ratio = value

    def needs(self) -> Needs:
        return self.press.needs()

    def needs_tokenizer(self) -> bool:
        return self.press.needs_tokenizer()
