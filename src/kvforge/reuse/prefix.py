"""Exact prefix reuse to the last matching token: hash-chained token blocks, plus the stored block a prompt branches
from.

The prompt is cut in blocks of ``B`` tokens (the last one may be shorter: the prompt's tail); each block is one stored
segment whose key and header carry the hash of its whole chain (:mod:`kvforge.reuse.chain`). A lookup walks the
chain to the first block not stored, then looks among the stored children of the last block found (the one its
header names, and those listed in its branch list) for the one sharing the most leading tokens with the prompt's
next block, and reuses it up to the last shared token. So a new question on a stored document prefills only the
question, whatever block boundary the document ends on. At least the last prompt token is always left to prefill
(its logits start decoding).

Recording writes the missing blocks head first and stops at the first write that fails (later blocks would be
unreachable without it), then touches the chain from its last block to its first, so under the stores' LRU a block
is always at least as recent as its descendants: suffix blocks are evicted before their prefixes. A partial tail is
stored once per prompt end; it is not written when a stored block already holds its tokens, and it is deleted once a
block that extends it has been written and listed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvforge.cache import KVCache
from kvforge.errors import StoreUnavailableError
from kvforge.reuse import chain as ch
from kvforge.reuse.base import PromptContext, ReusePlan, covers, full_layers_complete, holds_exactly, miss_plan
from kvforge.types import KVSegment, ReuseFacts

if TYPE_CHECKING:
    from kvforge.store.base import KVStore

logger = logging.getLogger(__name__)

KEY_PREFIX = ch.KEY_PREFIX
PRUNE_EVERY = 256  # written blocks between two sweeps of the branch lists of blocks no longer stored


@dataclass
class Branch:
    """A stored block that shares its first ``common`` tokens with the prompt's block starting at ``start``."""

    segment: KVSegment
    chain: str
    start: int
    common: int


@dataclass
class PrefixReuse:
    """Longest cached prefix, to the last matching token, over hash-chained token blocks.

    Args:
        store: a ``KVStore`` (get/put/contains/delete and blobs; ``touch`` used when the store has it).
        model_id: model + tokenizer fingerprint (``Engine.model_id``); part of every key.
        block_size: tokens per block (256 as LMCache); a hit ends at any token, not only at block ends.
        device: where loaded entries go (the model's device); None = as stored.
        max_branches: children listed per stored block beyond the one its header names (newest kept).
    """

    store: KVStore
    model_id: str
    block_size: int = 256
    device: Any = None
    max_branches: int = ch.MAX_BRANCHES
    _warned: set[str] = field(default_factory=set, init=False, repr=False)


    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_branches < 1:
            raise ValueError(f"max_branches must be >= 1, got {self.max_branches}")
        if not self.model_id:
            raise ValueError("model_id must name the model and tokenizer (keys would collide across models)")
        self.root = ch.chain_root(self.model_id, self.block_size)
        self._written_since_prune = 0

    # ------------------------------------------------------------------------------------------------ keys
    def block_bounds(self, num_tokens: int) -> list[tuple[int, int]]:
        """``[(start, end), ...]`` of the blocks of a ``num_tokens`` prompt (last one possibly partial)."""
        return [(s, min(s + self.block_size, num_tokens)) for s in range(0, num_tokens, self.block_size)]

    def block_chains(self, token_ids: Sequence[int]) -> list[str]:
        """Chain digest of every block of ``token_ids`` (digest i names the model and every token to block i's end)."""
        chains, parent = [], self.root
        for start, end in self.block_bounds(len(token_ids)):
            parent = ch.next_digest(parent, token_ids[start:end])
            chains.append(parent)
        return chains

    def block_keys(self, token_ids: Sequence[int]) -> list[str]:
        """Store key of every block of ``token_ids``."""
        return [ch.block_key(c) for c in self.block_chains(token_ids)]

    def _parent(self, chains: list[str], i: int) -> str:
        return chains[i - 1] if i else self.root

    # ------------------------------------------------------------------------------------------------ plan
    def plan(
        self, token_ids: Sequence[int], *, text: str | None = None, context: PromptContext | None = None
    ) -> ReusePlan:
        """Load the longest stored prefix of ``token_ids``; the rest (at least the last token) is to prefill."""
        ids = list(token_ids)  # an empty prompt is refused by miss_plan
        t0 = time.perf_counter()
        bounds, chains = self.block_bounds(len(ids)), self.block_chains(ids)
        num_hit = 0
        while num_hit < len(chains) and self.store.contains(ch.block_key(chains[num_hit])):
            num_hit += 1
        blocks, branch = self._load(ids, bounds, chains, num_hit)
        segments = blocks + ([branch.segment] if branch is not None else [])
        end = self._usable_end(blocks, branch, bounds, len(ids))
        if end == 0:
            return miss_plan(ids, store_keys_probed=num_hit + 1)
        used = [s for s in segments if s.meta["block_start"] < end]
        windows = used[0].meta.get("layer_windows")
        cache = KVCache.from_segments(used, end=end, layer_windows=windows, device=self.device)
        cache.reuse = ReuseFacts("prefix", end)
        info: dict[str, Any] = {"blocks": len(used), "load_s": time.perf_counter() - t0}
        if branch is not None and end > branch.start:
            info["branch_tokens"] = end - branch.start
            cache.info["prefix_branch"] = {
                "chain": branch.chain,
                "start": branch.start,
                "num_tokens": branch.segment.num_tokens,
                "common": branch.common,
                "entries": ch.entries_below(branch.segment, branch.start + branch.segment.num_tokens),
            }
        logger.debug("prefix hit: %d/%d tokens from %d blocks in %.3fs", end, len(ids), len(used), info["load_s"])
        return ReusePlan(cache=cache, reused_tokens=end, prefill_ids=ids[end:], kind="prefix", info=info)

    def _load(
        self, ids: list[int], bounds: list[tuple[int, int]], chains: list[str], num_hit: int
    ) -> tuple[list[KVSegment], Branch | None]:
        """The verified hit blocks (up to the first that fails) and the best stored branch after them.

        Read order keeps prefixes the most recent under LRU: the deepest hit block first (its header names a
        child), then the branch, then the deepest block again (a touch) and the others last to first."""
        got: dict[int, KVSegment | None] = {}
        branch = None
        if num_hit < len(bounds):
            parent = self._parent(chains, num_hit)
            if num_hit:
                got[num_hit - 1] = self.store.get(ch.block_key(parent))
            if not num_hit or self._problem(got[num_hit - 1], chains, num_hit - 1, bounds) is None:
                head = got.get(num_hit - 1)
                branch = self._find_branch(ids, bounds[num_hit][0], parent, head, is_root=not num_hit)
                if branch is not None and num_hit:
                    self._touch([ch.block_key(parent)])
        for i in reversed(range(num_hit)):
            if i not in got:
                got[i] = self.store.get(ch.block_key(chains[i]))
        blocks: list[KVSegment] = []
        for i in range(num_hit):
            seg = got[i]
            problem = "evicted meanwhile" if seg is None else self._problem(seg, chains, i, bounds)
            if problem is not None:
                if seg is not None:
                    self._reject(ch.block_key(chains[i]), bounds[i], problem)
                return blocks, None  # a miss for this block and everything after it
            assert seg is not None
            blocks.append(seg)
        return blocks, branch

    def _problem(self, seg: KVSegment | None, chains: list[str], i: int, bounds: list[tuple[int, int]]) -> str | None:
        if seg is None:
            return "evicted meanwhile"
        return ch.block_problem(
            seg, model_id=self.model_id, parent=self._parent(chains, i), start=bounds[i][0], chain=chains[i],
            block_size=self.block_size,
        )  # fmt: skip

    def _reject(self, key: str, bounds: tuple[int, int], problem: str) -> None:
        """One warning, and the wrong block removed (so the right one can be stored again)."""
        logger.warning(
            "prefix block at tokens [%d, %d) is not this prompt's (%s): treated as a miss from there on, and removed",
            *bounds,
            problem,
        )
        with contextlib.suppress(OSError, StoreUnavailableError):
            self.store.delete(key)

    def _find_branch(
        self, ids: list[int], start: int, parent: str, head: KVSegment | None, *, is_root: bool
    ) -> Branch | None:
        """The stored child of ``parent`` sharing the most leading tokens with ``ids[start:]`` (None if none does)."""
        query = ids[start : start + self.block_size]
        candidates: dict[str, list[int]] = {}
        first = head.meta.get("next") if head is not None else None
        if isinstance(first, list) and first:
            with contextlib.suppress(TypeError, ValueError):
                candidates[ch.next_digest(parent, first)] = [int(t) for t in first]
        for chain, tokens in self._children(parent, is_root):
            candidates.setdefault(chain, tokens)
        ranked = sorted(candidates.items(), key=lambda item: -ch.common_prefix(item[1], query))
        for chain, tokens in ranked[:3]:  # a listed child may be gone (evicted) or wrong: try the next best
            if ch.common_prefix(tokens, query) == 0:
                break
            key = ch.block_key(chain)
            seg = self.store.get(key)
            if seg is None:
                continue
            problem = ch.block_problem(
                seg, model_id=self.model_id, parent=parent, start=start, chain=chain, block_size=self.block_size
            )
            if problem is not None:
                self._reject(key, (start, start + seg.num_tokens), problem)
                continue
            common = ch.common_prefix(seg.token_ids, query)
            return Branch(seg, chain, start, common) if common else None
        return None

    def _children(self, parent: str, is_root: bool) -> list[tuple[str, list[int]]]:
        """The listed children of ``parent``; on a tiered store the union of every tier's list (a process's memory
        tier keeps its own copy: the shared tiers hold what other processes listed since)."""
        key = ch.list_key(parent, is_root)
        merged: dict[str, list[int]] = {}
        for source in getattr(self.store, "tiers", None) or [self.store]:
            try:
                raw = source.get_blob(key)
            except (OSError, StoreUnavailableError):
                continue
            for chain, tokens in ch.decode_list(parent, raw):
                merged.setdefault(chain, tokens)
        return list(merged.items())

    def _usable_end(
        self, blocks: list[KVSegment], branch: Branch | None, bounds: list[tuple[int, int]], num_tokens: int
    ) -> int:
        """Longest reusable prefix: the last shared token (minus 1 on a full hit), else a block end, where every
        layer holds what a query there attends to (sliding-window layers may have dropped old entries)."""
        segments = blocks + ([branch.segment] if branch is not None else [])
        if not segments:
            return 0
        ends = [bounds[i][1] for i in range(len(blocks))]
        if branch is not None:
            ends.append(branch.start + branch.common)
        for end in sorted({min(e, num_tokens - 1) for e in ends}, reverse=True):
            if end > 0 and covers(segments, end):
                return end
        return 0

    # ------------------------------------------------------------------------------------------------ record
    def record(
        self,
        token_ids: Sequence[int],
        cache: KVCache,
        *,
        text: str | None = None,
        context: PromptContext | None = None,
    ) -> None:
        """Store the blocks of ``token_ids`` not stored yet, head first (the cache must hold exactly these tokens'
        full KV); the first write that fails ends the chain there."""
        ids = list(token_ids)
        if not ids or not holds_exactly(cache, ids):
            return
        bounds, chains = self.block_bounds(len(ids)), self.block_chains(ids)
        windows = list(cache.native_windows)
        branch = cache.info.get("prefix_branch") if isinstance(cache.info.get("prefix_branch"), dict) else None
        reused = cache.reuse.reused_tokens if cache.reuse is not None else 0
        written: dict[int, KVSegment] = {}
        chain_idx: list[int] = []
        for i, (start, end) in enumerate(bounds):
            key = ch.block_key(chains[i])
            if self.store.contains(key):
                chain_idx.append(i)
                continue
            if i == len(bounds) - 1 and self._served_by(branch, start, end, reused):
                break  # the tail is the head of a stored block: a lookup finds it there
            seg = self._block(cache, ids, bounds, chains, i, windows)
            if seg is None or not self._put(key, seg, bounds[i], len(ids)):
                break
            written[i] = seg
            chain_idx.append(i)
        for i, seg in written.items():
            if i - 1 not in written:  # its parent was stored before: list it there
                self._register(chains, i, seg, branch)
        self._touch([ch.block_key(chains[i]) for i in reversed(chain_idx)])
        self._written_since_prune += len(written)
        if self._written_since_prune >= PRUNE_EVERY:
            self.prune()
        logger.debug("prefix record: %d new blocks, %d already stored", len(written), len(chain_idx) - len(written))

    def _served_by(self, branch: dict[str, Any] | None, start: int, end: int, reused: int) -> bool:
        """Whether the stored branch the plan used already holds the tail ``[start, end)`` (the plan reused it)."""
        return (
            branch is not None
            and branch.get("start") == start
            and int(branch.get("common", 0)) >= end - start
            and reused >= end - 1
        )

    def _block(
        self,
        cache: KVCache,
        ids: list[int],
        bounds: list[tuple[int, int]],
        chains: list[str],
        i: int,
        windows: list[int | None],
    ) -> KVSegment | None:
        """Block ``i`` as a segment with its chain header, or None if the cache cannot give all its entries."""
        start, end = bounds[i]
        try:
            seg = cache.to_segment(self.model_id, ids[start:end], start=start, end=end)
        except ValueError as e:
            logger.debug("not recording prefix blocks: %s", e)
            return None
        if not full_layers_complete(seg, windows, end - start):
            logger.debug("cache lacks entries of block [%d, %d) (compressed?); stopping there", start, end)
            return None
        next_ids = ids[end : end + self.block_size]
        seg.meta = ch.block_meta(chains[i], self._parent(chains, i), start, windows, next_ids)
        return seg

    def _put(self, key: str, seg: KVSegment, bounds: tuple[int, int], num_tokens: int) -> bool:
        """Store one block; False when it is not stored (an OSError is ONE warning per cause; a store that skipped
        the write itself, being full, read-only or too small, has said so already)."""
        try:
            self.store.put(key, seg)
        except (OSError, StoreUnavailableError) as e:
            cause = type(e).__name__ + (f"[{e.errno}]" if isinstance(e, OSError) and e.errno else "")
            log = logger.debug if cause in self._warned else logger.warning
            self._warned.add(cause)
            log(
                "prefix reuse: block [%d, %d) of a %d-token prompt not stored (%s); the blocks after it are not "
                "stored either (unreachable without it)",
                *bounds,
                num_tokens,
                getattr(e, "strerror", None) or e,
            )
            return False
        return bool(self.store.contains(key))

    def _register(self, chains: list[str], i: int, seg: KVSegment, branch: dict[str, Any] | None) -> None:
        """List block ``i`` among its parent's children; a partial tail it extends is then dropped (list and KV)."""
        parent = self._parent(chains, i)
        start = seg.meta["block_start"]
        drop = None
        if (
            branch is not None
            and branch.get("start") == start
            and int(branch.get("num_tokens", 0)) < min(self.block_size, seg.num_tokens)
            and int(branch.get("common", 0)) >= int(branch["num_tokens"])
            and all(  # this block holds every entry the tail held (sliding layers may have dropped some)
                mine >= theirs
                for mine, theirs in zip(
                    ch.entries_below(seg, start + int(branch["num_tokens"])), branch.get("entries") or [], strict=False
                )
            )
        ):
            drop = str(branch["chain"])
        if self.list_child(parent, chains[i], seg.token_ids, drop=drop) and drop is not None:
            with contextlib.suppress(OSError, StoreUnavailableError):
                self.store.delete(ch.block_key(drop))

    def list_child(self, parent: str, chain: str, token_ids: Sequence[int], *, drop: str | None = None) -> bool:
        """List the stored block ``chain`` (holding ``token_ids``) first among the children of ``parent`` (the chain
        root for a prompt's first block), removing ``drop`` from the list; True when the store holds that list
        afterwards. Other engines writing these blocks (the vLLM connector) list them here too."""
        is_root = parent == self.root
        key = ch.list_key(parent, is_root)
        try:
            entries = [e for e in self._children(parent, is_root) if e[0] not in (chain, drop)]
            entries.insert(0, (chain, [int(t) for t in token_ids]))
            data = ch.encode_list(parent, entries[: self.max_branches])
            self.store.put_blob(key, data)
            return drop is None or self.store.get_blob(key) == data
        except (OSError, StoreUnavailableError) as e:
            logger.debug("prefix reuse: children of a block not listed (%s)", e)
            return False

    def _touch(self, keys: list[str]) -> None:
        """Mark stored blocks as used, in the order given (last = most recent)."""
        touch = getattr(self.store, "touch", None)
        for key in keys:
            with contextlib.suppress(OSError, StoreUnavailableError):
                if touch is not None:
                    touch(key)
                else:
                    self.store.contains(key)

    def prune(self) -> int:
        """Delete the children lists of blocks no longer stored (evicted); returns how many were deleted."""
        removed = 0
        try:
            for key in self.store.blob_keys():
                if key.startswith(ch.BRANCHES_PREFIX) and not self.store.contains(
                    ch.block_key(key[len(ch.BRANCHES_PREFIX) :])
                ):
                    self.store.delete_blob(key)
                    removed += 1
        except (OSError, StoreUnavailableError) as e:
            logger.debug("prefix reuse: branch lists not pruned (%s)", e)
        self._written_since_prune = 0
        return removed
