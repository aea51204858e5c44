"""The sampling parameters' rules, checkable without torch: one home for the server's schema, the CLI (and its config
file) and :class:`kvforge.decode.SamplingParams`, so each refuses a value with the same one-line message.

A ``temperature`` is 0 (greedy) or at least :data:`MIN_TEMPERATURE`. Below it, as in vLLM (whose sampler treats
temperatures under the same 1e-5 as greedy), dividing logits by the temperature overflows (1e-38 gives inf, then NaN
probabilities); kvforge refuses such a value rather than guess what it asks for.

>>> check_temperature(1e-38)
Traceback (most recent call last):
...
kvforge.errors.UserError: temperature must be 0 (greedy) or at least 1e-05, got 1e-38
"""

from __future__ import annotations

import math

from kvforge.errors import UserError

MIN_TEMPERATURE = 1e-5


def check_temperature(value: float) -> float:
    """``value`` if it is 0 or a finite number >= :data:`MIN_TEMPERATURE`; else a :class:`UserError`."""
    if value == 0 or (math.isfinite(value) and value >= MIN_TEMPERATURE):
        return value
    raise UserError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {value!r}")


def check_top_p(value: float) -> float:
    """``value`` if it is in (0, 1]; else a :class:`UserError`."""
    if 0 < value <= 1:
        return value
    raise UserError(f"top_p must be in (0, 1], got {value!r}")


def check_top_k(value: int) -> int:
    """``value`` if it is >= 0 (0: no top-k cut); else a :class:`UserError`."""
    if value >= 0:
        return value
    raise UserError(f"top_k must be >= 0, got {value!r}")
