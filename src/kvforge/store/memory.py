"""``memory://?max_bytes=N``: encoded segments in this process's memory, least recently used evicted past N bytes.

Entries are kept encoded (the same bytes as on disk or in Redis): the byte bound is exact, quantisation applies, a
tiered store promotes without re-encoding, and a caller mutating a returned segment cannot alter the stored one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from kvforge.store import codec
from kvforge.store.base import ByteStore, Kind, check_key, usage_report

log = logging.getLogger(__name__)

DEFAULT_MEMORY_BYTES = 1 << 30


class MemoryStore(ByteStore):
    """LRU over encoded entries, bounded by ``max_bytes`` (blobs are kept aside and not counted)."""

    scheme = "memory"
    verifies_checksum = False  # bytes held by this process are not re-hashed on every hit

    def __init__(self, max_bytes: int = DEFAULT_MEMORY_BYTES, quant: str | None = None) -> None:
        super().__init__(quant)
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()  # least recently used first
        self._blobs: dict[str, bytes] = {}
        self._bytes = 0

    def read(self, key: str, kind: Kind = "seg") -> bytes | None:
        with self.lock:
            if kind == "blob":
                return self._blobs.get(key)
            data = self._entries.get(key)
            if data is not None:
                self._entries.move_to_end(key)
            return data

    def write(self, key: str, data: bytes, kind: Kind = "seg") -> bool:
        data = bytes(data)
        with self.lock:
            if kind == "blob":
                self._blobs[check_key(key)] = data
                return True
            if len(data) > self.max_bytes:
                log.warning(
                    "memory store: entry %s (%d bytes) exceeds max_bytes=%d; not stored", key, len(data), self.max_bytes
                )
                return False
            self.remove(key)
            self._entries[key] = data
            self._bytes += len(data)
            while self._bytes > self.max_bytes:
                old, old_data = self._entries.popitem(last=False)
                self._bytes -= len(old_data)
                self.num_evicted += 1
                log.debug("memory store: evicted %s (%d bytes)", old, len(old_data))
        return True

    def remove(self, key: str, kind: Kind = "seg") -> None:
        with self.lock:
            if kind == "blob":
                self._blobs.pop(key, None)
                return
            data = self._entries.pop(key, None)
            if data is not None:
                self._bytes -= len(data)

    def has(self, key: str, kind: Kind = "seg") -> bool:
        return key in (self._blobs if kind == "blob" else self._entries)

    def list_keys(self, kind: Kind = "seg") -> list[str]:
        with self.lock:
            return list(self._blobs if kind == "blob" else self._entries)

    def stored_size_raw(self, key: str) -> int | None:
        data = self._entries.get(key)
        return None if data is None else len(data)

    def read_header(self, key: str) -> dict[str, Any] | None:
        data = self._entries.get(key)  # peek: no LRU update
        return None if data is None else codec.read_header(data)

    def usage(self) -> dict[str, Any]:
        with self.lock:
            url = f"memory://?max_bytes={self.max_bytes}"
            blob_sizes = [len(b) for b in self._blobs.values()]
            return usage_report(url, len(self._entries), self._bytes, self.max_bytes, blob_sizes)
