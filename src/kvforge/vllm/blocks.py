"""Store blocks as kvforge prefix segments: built from a paged cache's keys/values, checked before any KV is loaded,
and written by a background thread so a step never waits for the disk or the network.

A block saved here is the segment :class:`kvforge.reuse.prefix.PrefixReuse` records for the same tokens (same key,
same header: ``layer_windows``, ``block_start``; positions ``start..end-1`` on every head), so kvforge's own engine
and a vLLM server on one store reuse each other's blocks when they serve the same weights.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvforge.reuse.prefix import KEY_PREFIX
from kvforge.types import KVSegment

if TYPE_CHECKING:
    from kvforge.store.base import KVStore
    from kvforge.vllm.plan import BlockMove

logger = logging.getLogger(__name__)


def block_segment(move: BlockMove, keys: Sequence[Tensor], values: Sequence[Tensor], model_id: str) -> KVSegment:
    """The segment of store block ``move`` from per-layer ``(H_kv, S, D)`` keys and values (moved to the CPU)."""
    num_heads = keys[0].shape[0]
    positions = torch.arange(move.start, move.end, dtype=torch.long).expand(num_heads, -1)
    num_layers = len(keys)
    return KVSegment(
        token_ids=list(move.token_ids),
        keys=[k.to("cpu").contiguous() for k in keys],
        values=[v.to("cpu").contiguous() for v in values],
        positions=[positions.clone() for _ in range(num_layers)],
        valid=[None] * num_layers,
        next_position=move.end,
        model_id=model_id,
        meta={"layer_windows": [None] * num_layers, "block_start": move.start, "format": KEY_PREFIX},
    )


def check_block(
    segment: KVSegment, move: BlockMove, model_id: str, num_layers: int, num_kv_heads: int, head_size: int
) -> str | None:
    """Why ``segment`` may not fill ``move`` (None = it may): another model, other tokens, another shape."""
    size = move.end - move.start
    if segment.model_id != model_id:
        return f"made by model {segment.model_id!r}, not {model_id!r}"
    if segment.token_ids != list(move.token_ids) or segment.next_position != move.end:
        return f"does not hold tokens [{move.start}, {move.end}) of this prompt"
    if segment.num_layers != num_layers:
        return f"has {segment.num_layers} layers, the model {num_layers}"
    expected = torch.arange(move.start, move.end)
    for k, v, p, m in zip(segment.keys, segment.values, segment.positions, segment.valid, strict=True):
        if m is not None or k.shape != (num_kv_heads, size, head_size) or v.shape != k.shape:
            return f"holds KV of shape {tuple(k.shape)}, expected {(num_kv_heads, size, head_size)}"
        if not torch.equal(p[0].cpu(), expected):
            return "holds compressed or shifted entries (positions are not the block's)"
    return None


class BlockWriter:
    """Writes segments to a store from one background thread, in order; ``flush`` waits for what was queued.

    A failed write (a full disk, a store that went away) is logged and dropped: a block not written is a later
    miss, never an error for the request that computed it. At most ``max_pending`` segments wait in memory; past
    that ``put`` blocks the caller (the model step) rather than grow memory without bound.
    """

    def __init__(self, store: KVStore, quant: str | None = None, max_pending: int = 32) -> None:
        self.store = store
        self.quant = quant
        self.num_written = 0
        self.num_failed = 0
        self._queue: queue.Queue[tuple[str, KVSegment] | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._run, name="kvforge-block-writer", daemon=True)
        self._thread.start()

    def put(self, key: str, segment: KVSegment) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the block writer is closed")
        self._queue.put((key, segment))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, segment = item
                try:
                    self.store.put(key, segment, quant=self.quant)
                    self.num_written += 1
                except Exception as e:  # never let a store fault kill the writer: the block is a later miss
                    self.num_failed += 1
                    logger.warning("kvforge connector: block %s not stored: %s", key[:24], e)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued segment is written (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
