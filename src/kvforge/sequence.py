"""A :class:`Sequence`: one request inside the engine, from its plan to its :class:`~kvforge.types.Generation`.

It holds the request's cache (the plan's loaded entries, or a new one), the prompt units still to prefill, the logits
its next token is picked from, its :class:`~kvforge.decode.DecodeState` and its clocks. The engine moves it:
prefilling (``units`` left) -> decoding -> finished (``generation`` or ``error`` set).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

from kvforge.cache import CacheSnapshot, KVCache
from kvforge.decode import DecodeState
from kvforge.request import Encoded, Request
from kvforge.reuse.base import ReusePlan
from kvforge.types import Generation

if TYPE_CHECKING:
    from kvforge.presses.base import Press
    from kvforge.reuse.base import ReuseStrategy

__all__ = ["Sequence", "Unit"]


@dataclass
class Unit:
    """Prompt tokens to prefill: after the cache's entries, or at ``positions``; under ``press`` or not.

    A unit with a press (it scores the whole unit) or with positions (a RAG recompute) runs alone, in one go; the
    others are cut into chunks that share a step's forward with other sequences. ``is_document``: the cache right
    after this unit is the document a document strategy records.
    """

    ids: list[int]
    press: Press | None = None
    positions: list[int] | None = None
    is_document: bool = False

    @property
    def runs_alone(self) -> bool:
        return self.press is not None or self.positions is not None


@dataclass(eq=False)
class Sequence:
    """One request in flight. ``error`` set: it ended without an answer (the engine's caller raises it)."""

    request: Request
    encoded: Encoded
    plan: ReusePlan
    strategy: ReuseStrategy | None
    cache: KVCache
    units: list[Unit]
    state: DecodeState | None
    started: float = field(default_factory=time.perf_counter)
    plan_s: float = 0.0
    offset: int = 0  # tokens of units[0] prefilled so far
    logits: Tensor | None = None  # (1, V): the next token is picked from these
    document: CacheSnapshot | None = None
    prefilled_at: float | None = None
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    generation: Generation | None = None
    error: BaseException | None = None
    tag: Any = None  # the caller's handle (the server's job)

    @property
    def is_prefilling(self) -> bool:
        return bool(self.units) and not self.is_finished

    @property
    def is_finished(self) -> bool:
        return self.generation is not None or self.error is not None

    @property
    def num_prompt_left(self) -> int:
        """Prompt tokens still to prefill."""
        return sum(len(u.ids) for u in self.units) - self.offset

    def result(self) -> Generation:
        """The generation, or the error that ended the sequence."""
        if self.error is not None:
            raise self.error
        assert self.generation is not None, "the sequence has not finished"
        return self.generation
