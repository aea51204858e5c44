"""How many CPU threads a small step uses: chosen by measuring, step after step.

A decode step forwards one token per running sequence, a short chat prompt a few dozen: small matrix products, so an
OpenMP team spends much of each step at its barriers. When the cores are shared with other work, a team member that
the OS deschedules stalls every barrier of the step; with the bundled 135M model on two busy cores, one thread
decoded 2.7-3.7x faster than two, while on idle cores two threads are the faster choice. vLLM's CPU build settles it
by keeping one core for its front end; here neither choice is fixed: :class:`SmallStepThreads` keeps a running
average of the seconds per token of a step for one thread and for the full team, uses the faster, and tries the
other again now and then (the more it lost, the less often), so a machine that gets busier or quieter is followed
within a few dozen steps.

Steps of more than ``SMALL_STEP`` tokens (prefill chunks: large products that threads do speed up) always run with
the full team.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

SMALL_STEP = 64  # tokens in a step (decode rows + prompt tokens) up to which the team size is chosen by measuring
PROBE_EVERY = 16  # decode steps between two tries of the slower team size (times how much slower it was, capped)
MAX_BACKOFF = 8
SMOOTHING = 0.3  # weight of the newest step in the running averages


class SmallStepThreads:
    """The team size of small CPU steps: ``pick()`` before a step, ``observe(size, seconds, tokens)`` after.

    ``max_threads``: the full team (None: torch's setting when the first step runs). A team of one (``OMP_NUM_THREADS
    =1``, ``torch.set_num_threads(1)``) leaves nothing to choose.
    """

    def __init__(self, max_threads: int | None = None) -> None:
        if max_threads is not None and max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.avg: dict[int, float] = {}  # team size -> seconds per token of a step (running average)
        self.steps = 0
        self._next_probe = PROBE_EVERY

    def sizes(self) -> list[int]:
        full = self.max_threads or torch.get_num_threads()
        return sorted({1, full}, reverse=True)

    def pick(self) -> int:
        sizes = self.sizes()
        self.steps += 1
        untried = [n for n in sizes if n not in self.avg]
        if untried:
            return untried[0]
        best = min(sizes, key=self.avg.__getitem__)
        if len(sizes) > 1 and self.steps >= self._next_probe:
            other = next(n for n in sizes if n != best)
            slower = self.avg[other] / max(self.avg[best], 1e-12)
            self._next_probe = self.steps + int(PROBE_EVERY * min(MAX_BACKOFF, max(1.0, slower)))
            return other
        return best

    def observe(self, size: int, seconds: float, tokens: int) -> None:
        per_token = seconds / max(tokens, 1)
        old = self.avg.get(size)
        self.avg[size] = per_token if old is None else (1 - SMOOTHING) * old + SMOOTHING * per_token

    @property
    def preferred(self) -> int | None:
        """The faster team size so far (None before both were measured)."""
        sizes = self.sizes()
        if any(n not in self.avg for n in sizes):
            return None
        return min(sizes, key=self.avg.__getitem__)


@contextmanager
def team(size: int) -> Iterator[None]:
    """Run the block with ``size`` torch CPU threads, then give back the number there was (a process-wide setting)."""
    before = torch.get_num_threads()
    if size == before:
        yield
        return
    torch.set_num_threads(size)
    try:
        yield
    finally:
        torch.set_num_threads(before)
