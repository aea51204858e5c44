"""The scheduler side of the connector, without vLLM: which stored blocks a request can load, and which of its
blocks to save at each step.

A prompt is cut in store blocks of ``store_block_size`` tokens (a multiple of vLLM's block size), named exactly
as :class:`kvforge.reuse.prefix.PrefixReuse` names its blocks: the chain digest of :mod:`kvforge.reuse.chain`
(the model fingerprint, the block size and every token to the block's end), its parent's digest, and the tokens
that follow it in the prompt. A lookup walks the chain to the first block the store lacks; the hit is cut to a
vLLM block boundary and leaves at least the prompt's last token to compute (its logits start decoding). Only
whole store blocks of the prompt are saved (decoded tokens are not), each as soon as the step that completes it
has run, whether its KV was computed, found in vLLM's own prefix cache or loaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvforge.reuse import chain as ch
from kvforge.vllm.documents import ServedDocument


@dataclass
class BlockMove:
    """One store block to load into, or save from, vLLM's paged cache.

    Args:
        chain: the block's chain digest (its store key is ``prefix-v2-<chain>``).
        parent: the chain digest of the block before it (the chain root for the prompt's first block).
        start, end: the block's tokens in the prompt, ``[start, end)``.
        token_ids: the prompt's tokens ``[start, end)`` (checked against a loaded segment, written into a saved one).
        first, last: the tokens actually moved, ``[first, last)`` inside ``[start, end)``: a load skips what vLLM
            already holds and stops where the hit stops; a save moves the whole block.
        block_ids: vLLM's blocks holding tokens ``[first, last)``, in order.
        next_ids: (saves) the prompt's tokens after the block, at most one block of them: the header's ``next``.
        listed: (saves) list the block among its parent's children, as ``PrefixReuse`` does for a block whose
            parent was stored before (a block following one saved for the same prompt is named by its ``next``).
    """

    chain: str
    parent: str
    start: int
    end: int
    token_ids: list[int]
    first: int
    last: int
    block_ids: list[int]
    next_ids: list[int] = field(default_factory=list)
    listed: bool = False

    @property
    def key(self) -> str:
        return ch.block_key(self.chain)


@dataclass
class DocumentMove:
    """A stored compressed document to write into a request's first slots: slots ``[first, last)`` of its
    ``doc.num_slots`` (vLLM's prefix cache may hold the first ones), held by vLLM's ``block_ids`` from the block of
    slot ``first`` on."""

    request_id: str
    doc: ServedDocument
    first: int
    last: int
    block_ids: list[int]


@dataclass
class StepMoves:
    """What the workers move around one model step: loads before it, saves after it; ``failed``: vLLM blocks the
    scheduler counts as loaded but that no load will fill (the workers report them, and vLLM recomputes them)."""

    loads: list[BlockMove] = field(default_factory=list)
    saves: list[BlockMove] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    documents: list[DocumentMove] = field(default_factory=list)


@dataclass
class _Running:
    prompt: list[int]
    chains: list[str]  # chain digests of the prompt's whole store blocks
    block_ids: list[int]
    saved_blocks: int = 0  # store blocks of the prompt already saved or found stored
    planned: set[int] = field(default_factory=set)  # store blocks this request planned to save

    @property
    def keys(self) -> list[str]:
        return [ch.block_key(c) for c in self.chains]


class TransferPlanner:
    """Per-request bookkeeping of the scheduler-side connector.

    Args:
        block_chains: prompt token ids -> the chain digest of each of its blocks (the last one may be partial):
            ``PrefixReuse.block_chains``.
        root: the chain root (``PrefixReuse.root``): the parent of a prompt's first block.
        contains: whether the store holds a key.
        block_size: vLLM's tokens per paged block.
        store_block_size: tokens per stored block, a multiple of ``block_size``.
        load, save: whether this connector loads stored blocks / saves new ones (``kv_role``).
        in_flight_s: a block planned for saving is not planned again for this long, even while the store does not
            hold it yet (the workers write in the background): two requests with one prefix save it once.
    """

    def __init__(
        self,
        block_chains: Callable[[Sequence[int]], list[str]],
        root: str,
        contains: Callable[[str], bool],
        block_size: int,
        store_block_size: int,
        load: bool = True,
        save: bool = True,
        in_flight_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1 or store_block_size < block_size or store_block_size % block_size:
            raise ValueError(
                f"the store block size ({store_block_size}) must be a multiple of vLLM's block size ({block_size})"
            )
        self.block_chains = block_chains
        self.root = root
        self.contains = contains
        self.block_size = block_size
        self.store_block_size = store_block_size
        self.load = load
        self.save = save
        self.in_flight_s = in_flight_s
        self.clock = clock
        self._pending_loads: dict[str, int] = {}  # request id -> external tokens to load (set after allocation)
        self._documents: dict[str, ServedDocument] = {}  # request id -> the stored document filling its first slots
        self.document_failed: set[str] = set()  # request ids whose document could not be loaded
        self._running: dict[str, _Running] = {}
        self._saving: dict[str, float] = {}  # key -> when its save was planned (written in the background since)

    # ------------------------------------------------------------------------------------------ lookup
    def _full_chains(self, prompt: Sequence[int]) -> list[str]:
        return self.block_chains(prompt)[: len(prompt) // self.store_block_size]

    def stored_tokens(self, prompt: Sequence[int]) -> int:
        """Tokens of ``prompt`` that loading can provide: the stored chain, cut to a vLLM block boundary and to at
        most ``len(prompt) - 1`` tokens."""
        if not self.load or len(prompt) < 2:
            return 0
        hit = 0
        for chain in self._full_chains(prompt):
            if not self.contains(ch.block_key(chain)):
                break
            hit += self.store_block_size
        usable = min(hit, len(prompt) - 1)
        return usable - usable % self.block_size

    def matched_tokens(self, prompt: Sequence[int], num_computed: int) -> int:
        """What ``get_num_new_matched_tokens`` answers: stored tokens beyond the ``num_computed`` vLLM holds."""
        return max(self.stored_tokens(prompt) - num_computed, 0)

    def match_document(self, request_id: str, doc: ServedDocument, num_computed: int) -> int:
        """A request whose first ``doc.num_slots`` tokens stand for stored document ``doc`` (checked by the
        caller): the slots left to load beyond the ``num_computed`` vLLM's prefix cache holds."""
        self._documents[request_id] = doc
        return max(doc.num_slots - num_computed, 0)

    def document_of(self, request_id: str) -> ServedDocument | None:
        return self._documents.get(request_id)

    def allocated(self, request_id: str, num_external: int) -> None:
        """``update_state_after_alloc``: remember how many tokens the scheduler will have loaded."""
        if num_external > 0:
            self._pending_loads[request_id] = num_external
        else:
            self._pending_loads.pop(request_id, None)

    # ------------------------------------------------------------------------------------------ steps
    def start(
        self,
        request_id: str,
        prompt: Sequence[int] | None,
        block_ids: Sequence[int],
        num_computed: int,
        num_scheduled: int,
        moves: StepMoves,
    ) -> None:
        """A request scheduled for the first time (or again after a preemption: its blocks are all new)."""
        if prompt is None:  # prompt embeddings: no token ids to key blocks by
            self.finish([request_id])
            return
        chains = [] if request_id in self._documents else self._full_chains(prompt)  # placeholders are never saved
        self._running[request_id] = _Running(list(prompt), chains, [])
        self.resume(request_id, block_ids, num_computed, num_scheduled, moves)

    def resume(
        self, request_id: str, block_ids: Sequence[int], num_computed: int, num_scheduled: int, moves: StepMoves
    ) -> None:
        """A request scheduled with all-new blocks (its first step, or again after a preemption)."""
        num_external = self._pending_loads.pop(request_id, 0)
        state = self._running.get(request_id)
        if state is None:
            return
        state.block_ids = list(block_ids)
        doc = self._documents.get(request_id)
        if num_external > 0 and doc is not None:
            first = num_computed - num_external
            blocks = state.block_ids[first // self.block_size : -(-num_computed // self.block_size)]
            moves.documents.append(DocumentMove(request_id, doc, first, num_computed, blocks))
        elif num_external > 0:
            moves.loads += self._loads(state, num_computed - num_external, num_computed)
        self._saves(state, num_computed + num_scheduled, moves)

    def advance(
        self, request_id: str, new_block_ids: Sequence[int] | None, num_computed: int, num_scheduled: int,
        moves: StepMoves,
    ) -> None:  # fmt: skip
        """A running request scheduled again: new blocks appended, the blocks this step completes saved."""
        state = self._running.get(request_id)
        if state is None:
            return
        if new_block_ids:
            state.block_ids += list(new_block_ids)
        self._saves(state, num_computed + num_scheduled, moves)

    def abandon(self, request_id: str, block_ids: Sequence[int], num_computed: int) -> list[int]:
        """The vLLM blocks of a planned load that will not happen (this step's planning failed): to recompute."""
        num_external = self._pending_loads.pop(request_id, 0)
        if num_external <= 0:
            return []
        first = (num_computed - num_external) // self.block_size
        return list(block_ids[first : -(-num_computed // self.block_size)])

    def failed(self, block_ids: set[int]) -> None:
        """vLLM blocks whose load failed: vLLM recomputes them, and the store blocks they hold are saved again."""
        for request_id, state in self._running.items():
            for i, block in enumerate(state.block_ids):
                if block in block_ids:
                    if request_id in self._documents:
                        self.document_failed.add(request_id)
                    first = i * self.block_size // self.store_block_size
                    state.saved_blocks = min(state.saved_blocks, first)
                    for key in state.keys[first:]:
                        self._saving.pop(key, None)
                    state.planned = {i for i in state.planned if i < first}
                    break

    def finish(self, request_ids: Sequence[str] | set[str]) -> None:
        for request_id in request_ids:
            self._running.pop(request_id, None)
            self._pending_loads.pop(request_id, None)
            self._documents.pop(request_id, None)
            self.document_failed.discard(request_id)

    def _move(self, state: _Running, index: int, first: int, last: int) -> BlockMove:
        start = index * self.store_block_size
        end = start + self.store_block_size
        blocks = state.block_ids[first // self.block_size : last // self.block_size]
        parent = state.chains[index - 1] if index else self.root
        return BlockMove(state.chains[index], parent, start, end, state.prompt[start:end], first, last, blocks)

    def _loads(self, state: _Running, first: int, last: int) -> list[BlockMove]:
        out = []
        for index in range(len(state.chains)):
            start, end = index * self.store_block_size, (index + 1) * self.store_block_size
            lo, hi = max(start, first), min(end, last)
            if lo < hi:
                out.append(self._move(state, index, lo, hi))
        return out

    def _saves(self, state: _Running, computed: int, moves: StepMoves) -> None:
        if not self.save:
            return
        done = min(min(computed, len(state.prompt)) // self.store_block_size, len(state.chains))
        if done <= state.saved_blocks:
            return
        now = self.clock()
        for key in [k for k, t in self._saving.items() if now - t > self.in_flight_s]:
            del self._saving[key]
        for index in range(state.saved_blocks, done):
            key = state.keys[index]
            if key in self._saving or self.contains(key):  # planned already: maybe still being written
                continue
            start = index * self.store_block_size
            move = self._move(state, index, start, start + self.store_block_size)
            move.next_ids = state.prompt[move.end : move.end + self.store_block_size]
            move.listed = index - 1 not in state.planned  # else the parent's header names it (its next)
            moves.saves.append(move)
            state.planned.add(index)
            self._saving[key] = now
        state.saved_blocks = done
