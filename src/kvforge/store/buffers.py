"""Read buffers that are used again once nothing refers to them: a read into memory already mapped costs about half
of a read into fresh memory (whose pages the kernel must fault in and zero first).

A disk read fills a buffer from :func:`take`; the segment decoded from it holds tensors that are views into it. When
the last of them (and every other view of the buffer) is gone, its memory goes back to a small free list, and the next
read of a similar size fills it instead of fresh memory. Nothing can reach the memory except through the array
:func:`take` returned, so it is only ever reused once unreachable (reference counting, not a caller's promise).
"""

from __future__ import annotations

import collections
import threading
import weakref

import numpy as np

MAX_FREE_BYTES = 512 << 20  # free memory kept for the next reads (per process); beyond it, the oldest is released
MAX_FREE = 4  # free buffers kept
SLACK = 1.25  # a free buffer serves a read of n bytes when it holds at most SLACK * n + 1 MiB

_lock = threading.Lock()
_free: list[np.ndarray] = []  # owners of free memory, oldest first
_returned: collections.deque[np.ndarray] = collections.deque()  # given back by finalizers (append is atomic)


def take(n: int, cls: type[np.ndarray] = np.ndarray) -> np.ndarray:
    """An uninitialised writable uint8 array of ``n`` bytes (of type ``cls``), recycled memory when some fits.

    Its memory returns to the free list when the array and everything viewing it (numpy views, memoryviews,
    tensors made with ``torch.frombuffer``) are gone."""
    with _lock:
        _collect()
        fits = [i for i, raw in enumerate(_free) if n <= raw.nbytes <= SLACK * n + (1 << 20)]
        raw = _free.pop(min(fits, key=lambda i: _free[i].nbytes)) if fits else None
    if raw is None:
        raw = np.empty(n, dtype=np.uint8)  # numpy asks for huge pages: the fastest fresh memory here
    # The array handed out sits on a memoryview of ``raw``, not on ``raw``: numpy collapses a view's base to the
    # nearest array that owns its memory, so a view of a plain view of ``raw`` would refer to ``raw`` directly and
    # outlive the finalizer's watch. A memoryview stops that collapse: every view refers to ``out`` (or to a view of
    # it), so ``out`` dies last.
    out = np.frombuffer(memoryview(raw), dtype=np.uint8, count=n)
    if cls is not np.ndarray:
        out = out.view(cls)  # its base is the plain array above, which is watched instead
        watched = out.base
    else:
        watched = out
    finalizer = weakref.finalize(watched, _returned.append, raw)
    finalizer.atexit = False
    return out


def _collect() -> None:
    """Move given-back buffers to the free list, releasing the oldest beyond the bounds (caller holds the lock)."""
    while _returned:
        _free.append(_returned.popleft())
    while _free and (len(_free) > MAX_FREE or sum(raw.nbytes for raw in _free) > MAX_FREE_BYTES):
        _free.pop(0)


def free_bytes() -> int:
    """Bytes held in the free list now."""
    with _lock:
        _collect()
        return sum(raw.nbytes for raw in _free)
