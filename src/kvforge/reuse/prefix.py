"""Exact prefix reuse: the prompt's tokens cut in blocks, one stored segment per block, keys hash-chained.

Block ``i`` covers tokens ``[i*B, (i+1)*B)`` (the last block may be shorter: the prompt's tail). Its key is
``sha256(key_{i-1} || uint32-LE(block ids))`` seeded by a namespace over the model fingerprint and block size, so it
names the whole prefix up to the block end, is identical across processes and machines, and never uses Python's
``hash``. A lookup walks the chain until the first missing block (so a hit is always a true prefix), loads the
blocks, and leaves at least the last prompt token to prefill (its logits start decoding).

Eviction order: every access to a chain touches its blocks from the last to the first (loads read in reverse,
records write in reverse and then touch the reused prefix in reverse), so under the stores' LRU a block is always at
least as recent as any of its descendants: suffix blocks are evicted before their prefixes. An orphaned suffix
(its parent gone by other means) is simply unreachable: the walk stops at the first missing block.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvforge.cache import KVCache
from kvforge.reuse.base import ReusePlan, covers, digest, encode_ids, full_layers_complete, holds_exactly, miss_plan
from kvforge.types import KVSegment

if TYPE_CHECKING:
    from kvforge.reuse.base import PromptContext
    from kvforge.store.base import KVStore

logger = logging.getLogger(__name__)

KEY_PREFIX = "prefix-v1-"


@dataclass
class PrefixReuse:
    """Longest cached prefix over hash-chained token blocks.

    Args:
        store: a ``KVStore`` (get/put/contains; ``touch`` used when the store has it).
        model_id: model + tokenizer fingerprint (``Engine.model_id``); part of every key.
        block_size: tokens per block (256 as LMCache); hits are block multiples, or the whole prompt.
        device: where loaded entries go (the model's device); None = as stored.
    """

    store: KVStore
    model_id: str
    block_size: int = 256
    device: Any = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.model_id:
            raise ValueError("model_id must name the model and tokenizer (keys would collide across models)")
        self.namespace = digest("kvforge-prefix-v1", self.model_id, str(self.block_size))

    # ------------------------------------------------------------------------------------------------ keys
    def block_bounds(self, num_tokens: int) -> list[tuple[int, int]]:
        """``[(start, end), ...]`` of the blocks of a ``num_tokens`` prompt (last one possibly partial)."""
        return [(s, min(s + self.block_size, num_tokens)) for s in range(0, num_tokens, self.block_size)]

    def block_keys(self, token_ids: Sequence[int]) -> list[str]:
        """Store key of every block of ``token_ids`` (hash-chained: key i depends on all tokens before its end)."""
        keys, parent = [], self.namespace
        for start, end in self.block_bounds(len(token_ids)):
            parent = digest(parent, encode_ids(token_ids[start:end]))
            keys.append(KEY_PREFIX + parent)
        return keys

    # ------------------------------------------------------------------------------------------------ plan
    def plan(
        self, token_ids: Sequence[int], *, text: str | None = None, context: PromptContext | None = None
    ) -> ReusePlan:
        """Load the longest stored prefix of ``token_ids``; the rest (at least the last token) is to prefill."""
        ids = list(token_ids)  # an empty prompt is refused by miss_plan
        t0 = time.perf_counter()
        bounds, keys = self.block_bounds(len(ids)), self.block_keys(ids)
        num_hit = 0
        while num_hit < len(keys) and self.store.contains(keys[num_hit]):
            num_hit += 1
        segments = self._load(keys[:num_hit], bounds[:num_hit], ids)
        end = self._usable_end(segments, bounds, len(ids))
        if end == 0:
            return miss_plan(ids, store_keys_probed=len(keys))
        segments = segments[: next(i for i, (_, e) in enumerate(bounds) if e >= end) + 1]
        windows = segments[0].meta.get("layer_windows")
        cache = KVCache.from_segments(segments, end=end, layer_windows=windows, device=self.device)
        cache.info["reuse"] = {"kind": "prefix", "reused_tokens": end, "approximate": False}
        load_s = time.perf_counter() - t0
        logger.debug("prefix hit: %d/%d tokens from %d blocks in %.3fs", end, len(ids), len(segments), load_s)
        return ReusePlan(
            cache=cache,
            reused_tokens=end,
            prefill_ids=ids[end:],
            kind="prefix",
            info={"blocks": len(segments), "load_s": load_s},
        )

    def _load(self, keys: list[str], bounds: list[tuple[int, int]], ids: list[int]) -> list[KVSegment]:
        """Get the hit blocks last-to-first (prefixes end most recent); stops before a missing or foreign block."""
        loaded: list[KVSegment | None] = [None] * len(keys)
        for i in reversed(range(len(keys))):
            loaded[i] = self.store.get(keys[i])
        out: list[KVSegment] = []
        for seg, (start, end) in zip(loaded, bounds, strict=True):
            if seg is None:
                break  # evicted between contains and get
            if seg.model_id != self.model_id or seg.token_ids != ids[start:end] or seg.next_position != end:
                logger.warning(
                    "prefix block at tokens [%d, %d) does not hold these tokens; treated as a miss", start, end
                )
                break
            out.append(seg)
        return out

    def _usable_end(self, segments: list[KVSegment], bounds: list[tuple[int, int]], num_tokens: int) -> int:
        """Longest reusable prefix length: a block end (minus 1 on a full hit) where every layer is complete."""
        candidates = [min(bounds[i][1], num_tokens - 1) for i in reversed(range(len(segments)))]
        for end in candidates:
            if end > 0 and covers(segments, end):
                return end
        return 0

    # ------------------------------------------------------------------------------------------------ record
    def record(
        self, token_ids: Sequence[int], cache: KVCache, *, text: str | None = None, context: PromptContext | None = None
    ) -> None:
        """Store the blocks of ``token_ids`` not stored yet (the cache must hold exactly these tokens' full KV)."""
        ids = list(token_ids)
        if not ids or not holds_exactly(cache, ids):
            return
        bounds, keys = self.block_bounds(len(ids)), self.block_keys(ids)
        windows = list(cache.native_windows)
        new: list[tuple[str, KVSegment]] = []
        present: list[str] = []
        for key, (start, end) in zip(keys, bounds, strict=True):
            if self.store.contains(key):
                present.append(key)
                continue
            try:
                seg = cache.to_segment(self.model_id, ids[start:end], start=start, end=end)
            except ValueError as e:
                logger.debug("not recording prefix blocks: %s", e)
                break
            if not full_layers_complete(seg, windows, end - start):
                logger.debug("cache lacks entries of block [%d, %d) (compressed?); stopping there", start, end)
                break
            seg.meta = {"layer_windows": windows, "block_start": start, "format": KEY_PREFIX}
            new.append((key, seg))
        for key, seg in reversed(new):  # suffix first: the prefix blocks end up the most recent
            self.store.put(key, seg)
        self._touch(list(reversed(present)))
        logger.debug("prefix record: %d new blocks, %d already stored", len(new), len(present))

    def _touch(self, keys: list[str]) -> None:
        """Mark already stored blocks as used, in the order given (last = most recent)."""
        touch = getattr(self.store, "touch", None)
        for key in keys:
            if touch is not None:
                touch(key)
            else:
                self.store.contains(key)
