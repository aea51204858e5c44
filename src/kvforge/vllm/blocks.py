"""Store blocks as kvforge prefix segments: built from a paged cache's keys/values, checked before any KV is loaded,
and written by a background thread so a step never waits for the disk or the network.

A block saved here is the segment :class:`kvforge.reuse.prefix.PrefixReuse` records for the same tokens: the same
key (``prefix-v2-<chain digest>``), the same header (:func:`kvforge.reuse.chain.block_meta`: format, chain, parent,
``block_start``, ``layer_windows``, ``next``), positions ``start..end-1`` on every head, and the same listing among
its parent's children. A block is loaded only when :func:`kvforge.reuse.chain.block_problem` accepts it (its parent
is the block before it in this prompt, its chain hash is that of its parent and its tokens, and it is the block the
key names), so kvforge's own engine and a vLLM server on one store reuse each other's blocks when they serve the
same weights, and a block copied from another chain is a miss for it and every block after it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvforge.errors import StoreUnavailableError
from kvforge.reuse import chain as ch
from kvforge.types import KVSegment

if TYPE_CHECKING:
    from kvforge.reuse.prefix import PrefixReuse
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
        meta=ch.block_meta(move.chain, move.parent, move.start, [None] * num_layers, move.next_ids),
    )


def check_block(
    segment: KVSegment, move: BlockMove, model_id: str, num_layers: int, num_kv_heads: int, head_size: int
) -> str | None:
    """Why ``segment`` may not fill ``move`` (None = it may): another model, another chain (the blocks before it
    differ, or its header does not hash to its key), other tokens, another shape."""
    size = move.end - move.start
    if segment.model_id != model_id:
        return f"made by model {segment.model_id!r}, not {model_id!r}"
    if segment.token_ids != list(move.token_ids) or segment.next_position != move.end:
        return f"does not hold tokens [{move.start}, {move.end}) of this prompt"
    problem = ch.block_problem(
        segment, model_id=model_id, parent=move.parent, start=move.start, chain=move.chain, block_size=size
    )
    if problem is not None:
        return f"is not this prompt's block: {problem}"
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
    """Writes the blocks one model step saved from one background thread, in order; ``flush`` waits for what was
    queued.

    A step's blocks are written as :meth:`PrefixReuse.record` writes a prompt's: head first (a full disk keeps the
    reachable head), a block whose parent failed is not written (it would be unreachable), the written blocks are
    touched last to first (under the stores' LRU a prefix is at least as recent as its suffixes), and a block whose
    parent was stored before is listed among that parent's children. A failed write (a full disk, a store that went
    away) is logged and dropped: a block not written is a later miss, never an error for the request that computed
    it. At most ``max_pending`` steps wait in memory; past that ``put`` blocks the caller (the model step) rather
    than grow memory without bound.
    """

    def __init__(
        self, store: KVStore, quant: str | None = None, max_pending: int = 32, prefix: PrefixReuse | None = None
    ) -> None:
        self.store = store
        self.quant = quant
        self.prefix = prefix  # lists blocks among their parent's children (None: not listed)
        self.num_written = 0
        self.num_failed = 0
        self._failed: dict[str, None] = {}  # chains of recent failed writes (bounded, insertion-ordered)
        self._queue: queue.Queue[list[tuple[BlockMove, KVSegment]] | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._run, name="kvforge-block-writer", daemon=True)
        self._thread.start()

    def put(self, blocks: list[tuple[BlockMove, KVSegment]]) -> None:
        """Queue one step's blocks (any order: written head first)."""
        if not self._thread.is_alive():
            raise RuntimeError("the block writer is closed")
        if blocks:
            self._queue.put(sorted(blocks, key=lambda item: item[0].start))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception as e:  # never let a fault kill the writer: the blocks are later misses
                logger.warning("kvforge connector: blocks not stored: %s", e)
            finally:
                self._queue.task_done()

    def _write(self, blocks: list[tuple[BlockMove, KVSegment]]) -> None:
        written: list[BlockMove] = []
        for move, segment in blocks:
            if move.parent in self._failed:
                self._fail(move.chain)
                continue
            try:
                self.store.put(move.key, segment, quant=self.quant)
            except Exception as e:  # the block is a later miss; so is every block after it
                self._fail(move.chain)
                logger.warning("kvforge connector: block %s not stored: %s", move.key[:24], e)
                continue
            self.num_written += 1
            self._failed.pop(move.chain, None)
            written.append(move)
            if move.listed and self.prefix is not None:
                self.prefix.list_child(move.parent, move.chain, move.token_ids)
        touch = getattr(self.store, "touch", None)
        for move in reversed(written) if touch is not None else ():
            with contextlib.suppress(OSError, StoreUnavailableError):
                touch(move.key)

    def _fail(self, chain: str) -> None:
        self.num_failed += 1
        self._failed[chain] = None
        while len(self._failed) > 4096:
            del self._failed[next(iter(self._failed))]

    def flush(self) -> None:
        """Wait until every queued block is written (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
