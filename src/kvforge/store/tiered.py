"""Tiered store (e.g. memory -> disk -> Redis): read the fastest tier holding a key, promote on hit, write through.

Promotion into the memory tier is immediate; into slower tiers (a Redis hit copied to disk) it runs on a background
thread, so a hit is not delayed by a disk write; ``flush()`` waits for it (``close()`` too, and so does interpreter
exit: the worker finishes its queue).

Each tier applies the stores' one rule for I/O errors (:class:`~kvforge.store.base.ByteStore`): a tier that cannot
read is a miss and the next tier is asked, a tier that cannot write (Redis down, a full or read-only disk) is skipped
with ONE warning per cause, and a recovery is logged. A tier found down when the store opens is warned about then.
Entries move between tiers as encoded bytes (no decode/encode on promotion).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from kvforge.errors import StoreUnavailableError
from kvforge.store import codec
from kvforge.store.base import ByteStore, ClearResult, Kind, check_key, describe_error, summarize_entries, wrap_blob
from kvforge.store.memory import MemoryStore
from kvforge.store.transform import basis_for_put
from kvforge.types import KVSegment

log = logging.getLogger(__name__)


class TieredStore:
    """Several byte stores, fastest first.

    Args:
        tiers: e.g. ``[MemoryStore(), DiskStore(path), RedisStore(url)]``.
        retry_s: seconds before a tier found unavailable is tried again.
    """

    scheme = "tiered"

    def __init__(self, tiers: list[ByteStore], retry_s: float = 30.0) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = tiers
        self.retry_s = retry_s
        self._down_until: dict[int, float] = {}
        self._warned: set[int] = set()
        self.tier_hits = [0] * len(tiers)
        self.misses = 0
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvforge-promote")
        self._pending: list[Future] = []
        for i, tier in enumerate(tiers):
            try:
                tier.ping()
            except StoreUnavailableError as e:  # warn now, at open, once: the tier's own rule then stays quiet
                log.warning("tiered store: tier %d (%s) is unavailable, continuing without it: %s", i, tier.scheme, e)
                tier.mark_unavailable(e)
                self._down_until[i] = time.monotonic() + self.retry_s
                self._warned.add(i)

    # ------------------------------------------------------------------------------------------ availability
    def _available(self, i: int) -> bool:
        return time.monotonic() >= self._down_until.get(i, 0.0)

    def _run(self, i: int, fn: Callable[[], Any], default: Any) -> Any:
        """Call ``fn`` on tier ``i``; if the tier is unavailable, mark it down and return ``default``."""
        if not self._available(i):
            return default
        try:
            out = fn()
        except StoreUnavailableError as e:
            self._down_until[i] = time.monotonic() + self.retry_s
            if i not in self._warned:
                self._warned.add(i)
                log.warning(
                    "tiered store: tier %d (%s) is unavailable, continuing without it: %s", i, self.tiers[i].scheme, e
                )
            else:
                log.debug("tiered store: tier %d still unavailable: %s", i, e)
            return default
        if i in self._warned and i in self._down_until:
            log.warning("tiered store: tier %d (%s) is available again", i, self.tiers[i].scheme)
            self._warned.discard(i)
        self._down_until.pop(i, None)
        return out

    # ------------------------------------------------------------------------------------------ protocol
    def get(self, key: str) -> KVSegment | None:
        """The first tier holding a readable copy answers; the bytes are then copied into the faster tiers."""
        check_key(key)
        for i, tier in enumerate(self.tiers):
            data = tier.load(key)
            if data is None:
                tier.misses += 1
                continue
            segment = tier.decode_or_discard(key, data)
            if segment is None:  # corrupt in this tier: try the next one
                continue
            tier.hits += 1
            self.tier_hits[i] += 1
            if i:
                self._promote(i, key, bytes(data))  # a copy: the segment's tensors are views into ``data``
            return segment
        self.misses += 1
        return None

    def _promote(self, i: int, key: str, data: bytes, kind: Kind = "seg") -> None:
        """Copy an entry found in tier ``i`` into the faster tiers (memory now, others in the background)."""
        for j in range(i):
            write = partial(self.tiers[j].save, key, [data], kind)
            if isinstance(self.tiers[j], MemoryStore):
                write()
            else:
                self._pending = [f for f in self._pending if not f.done()]
                self._pending.append(self._background.submit(_logged, write))

    def flush(self) -> None:
        """Wait for background promotions."""
        for future in self._pending:
            future.result()
        self._pending.clear()

    def put(self, key: str, segment: KVSegment, quant: str | None = None) -> None:
        """Write through to every available tier (encoded once per quantisation setting; ``quant`` overrides the
        tiers' own)."""
        check_key(key)
        encoded: dict[str | None, list[bytes | memoryview]] = {}
        for tier in self.tiers:
            tier_quant = tier.quant if quant is None else quant
            if tier_quant not in encoded:
                basis = basis_for_put(self, segment, tier_quant)  # kvtc: its basis kept as a blob of every tier
                encoded[tier_quant] = codec.encode_parts(segment, tier_quant, basis=basis)
            tier.save(key, encoded[tier_quant])

    def contains(self, key: str) -> bool:
        check_key(key)
        return any(t.contains(key) for t in self.tiers)

    def touch(self, key: str) -> None:
        for t in self.tiers:
            t.touch(key)

    def delete(self, key: str) -> None:
        check_key(key)
        for t in self.tiers:
            t.discard(key)

    def keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for t in self.tiers:
            seen.update(dict.fromkeys(t.keys()))
        return list(seen)

    def describe(self, key: str) -> dict[str, Any] | None:
        for t in self.tiers:
            found = t.describe(key) if t.contains(key) else None
            if found is not None:
                return found
        return None

    def clear(self) -> ClearResult:
        """Clear every tier; a tier that cannot be reached is reported as not cleared (key ``tier <i>``)."""
        result = ClearResult()
        for i, t in enumerate(self.tiers):
            try:
                result += t.clear()
            except t.io_errors as e:
                result.failed[f"tier {i} ({t.scheme})"] = describe_error(e)
        return result

    def put_blob(self, key: str, data: bytes) -> None:
        check_key(key)
        wrapped = wrap_blob(data)
        for t in self.tiers:
            t.save(key, [wrapped], "blob")

    def get_blob(self, key: str) -> bytes | None:
        check_key(key)
        for i, t in enumerate(self.tiers):
            found = t.get_blob(key)
            if found is not None:
                self._promote(i, key, wrap_blob(found), "blob")
                return found
        return None

    def blob_keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for t in self.tiers:
            seen.update(dict.fromkeys(t.blob_keys()))
        return list(seen)

    def delete_blob(self, key: str) -> None:
        for t in self.tiers:
            t.discard(key, "blob")

    def stats(self, deep: bool = False) -> dict[str, Any]:
        """Overall hits/misses, plus each tier's own stats (``hits`` there = requests that tier answered)."""
        tiers = []
        for i, t in enumerate(self.tiers):
            s = self._run(i, t.stats, None)
            tiers.append(s if s is not None else {"backend": t.scheme, "available": False})
        hits = sum(self.tier_hits)
        total = hits + self.misses
        out: dict[str, Any] = {
            "backend": "tiered",
            "entries": len(self.keys()),
            "hits": hits,
            "misses": self.misses,
            "hit_rate": hits / total if total else None,
            "tiers": tiers,
        }
        if deep:
            out |= summarize_entries([d for k in self.keys() if (d := self.describe(k)) is not None])
        return out

    def close(self) -> None:
        self.flush()
        self._background.shutdown(wait=True)
        for t in self.tiers:
            t.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _logged(fn: Callable[[], Any]) -> None:
    """Run a background write; an error there is a warning (the entry is still in the tier it came from)."""
    try:
        fn()
    except Exception as e:
        log.warning("tiered store: background promotion failed: %s", e)
