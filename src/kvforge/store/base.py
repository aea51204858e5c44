"""The KVStore protocol and the shared machinery of the byte-oriented backends (memory, disk, Redis).

A backend only moves bytes (``read``/``write``/``remove``/``list_keys``); :class:`ByteStore` turns them into the
:class:`KVStore` protocol through :mod:`kvforge.store.codec`: a corrupt entry is a miss with a warning (and is
removed), never an exception or wrong KV. Blobs are opaque bytes (the reuse layer's index files) wrapped with a
checksum; they are never evicted and do not count against ``max_bytes``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from abc import ABC, abstractmethod
from typing import Any, Literal, Protocol, runtime_checkable

from kvforge.errors import CorruptSegmentError, ModelMismatchError
from kvforge.store import codec
from kvforge.store.quant import canonical_quant
from kvforge.store.transform import basis_for_put
from kvforge.types import KVSegment

log = logging.getLogger(__name__)

Kind = Literal["seg", "blob"]
_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_BLOB_MAGIC = b"KVFBLOB1"


@runtime_checkable
class KVStore(Protocol):
    """Where KV segments live, addressed by caller-chosen keys (hex digests)."""

    def get(self, key: str) -> KVSegment | None: ...  # None on miss, and on a corrupt entry (with a warning)
    def put(self, key: str, segment: KVSegment, quant: str | None = None) -> None: ...  # quant: None = the store's
    def contains(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def keys(self) -> list[str]: ...
    def stats(self) -> dict: ...  # entries, bytes, capacity, hits, misses (per tier for a tiered store)
    def clear(self) -> None: ...
    def put_blob(self, key: str, data: bytes) -> None: ...
    def get_blob(self, key: str) -> bytes | None: ...
    def delete_blob(self, key: str) -> None: ...
    def blob_keys(self) -> list[str]: ...


def check_key(key: str) -> str:
    """Keys are file- and Redis-safe names: letters, digits, ``._-``, at most 200 characters."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ValueError(f"invalid store key {key!r}: use letters, digits, '.', '_' or '-' (e.g. a hex digest)")
    return key


def check_quant(quant: str | None) -> str | None:
    return canonical_quant(quant)  # ValueError naming the choices


def wrap_blob(data: bytes) -> bytes:
    """Blob bytes with a magic and a sha256, so a damaged blob reads as missing rather than as garbage."""
    return _BLOB_MAGIC + hashlib.sha256(data).digest() + bytes(data)


def unwrap_blob(raw: bytes | bytearray | memoryview) -> bytes:
    if len(raw) < 40 or raw[:8] != _BLOB_MAGIC:
        raise CorruptSegmentError("not a kvforge blob")
    data = bytes(raw[40:])
    if hashlib.sha256(data).digest() != bytes(raw[8:40]):
        raise CorruptSegmentError("blob checksum mismatch")
    return data


class ByteStore(ABC):
    """Base of the backends: the protocol on top of raw ``read``/``write`` of encoded entries.

    Args:
        quant: optional int8 quantisation applied when encoding (``int8-channel``, ``int8-token``, ``int8-kivi``).
    """

    scheme = ""

    def __init__(self, quant: str | None = None) -> None:
        self.quant = check_quant(quant)
        self.hits = 0
        self.misses = 0
        self.num_corrupt = 0
        self.num_evicted = 0
        self.lock = threading.RLock()

    # ------------------------------------------------------------------------ raw bytes (backends implement)
    @abstractmethod
    def read(self, key: str, kind: Kind = "seg") -> bytes | bytearray | memoryview | None:
        """The stored bytes, or None; a segment read counts as a use for LRU."""

    @abstractmethod
    def write(self, key: str, data: bytes, kind: Kind = "seg") -> None:
        """Store bytes (atomically: a reader sees the old entry, the new one, or none)."""

    def write_parts(self, key: str, parts: list[bytes | memoryview], kind: Kind = "seg") -> None:
        """Store the concatenation of ``parts`` (backends that stream override this to skip the join)."""
        self.write(key, b"".join(parts), kind)

    @abstractmethod
    def remove(self, key: str, kind: Kind = "seg") -> None:
        """Drop an entry if present."""

    @abstractmethod
    def list_keys(self, kind: Kind = "seg") -> list[str]:
        """Keys held, least recently used first when the backend knows."""

    @abstractmethod
    def usage(self) -> dict[str, Any]:
        """``entries``, ``bytes``, ``capacity``, ``blobs``, ``blob_bytes`` and backend facts."""

    def has(self, key: str, kind: Kind = "seg") -> bool:
        return check_key(key) in set(self.list_keys(kind))

    def read_header(self, key: str) -> dict[str, Any] | None:
        """The JSON header of a stored segment (backends override to avoid reading the payload)."""
        data = self.read(key)
        return None if data is None else codec.read_header(data)

    def touch(self, key: str) -> None:
        """Mark an entry as just used (LRU) without decoding it; e.g. prefixes after their suffixes."""
        self.read(check_key(key))

    def ping(self) -> None:  # noqa: B027 (optional hook)
        """Raise :class:`kvforge.errors.StoreUnavailableError` when the backend cannot be reached."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections or handles."""

    # ------------------------------------------------------------------------ protocol
    def decode_or_discard(self, key: str, data: bytes | bytearray | memoryview) -> KVSegment | None:
        """Decode stored bytes; a corrupt entry is removed and reported once as a warning (None)."""
        try:
            digest = getattr(data, "payload_checksum", None)  # computed while reading (disk)
            parsed = getattr(data, "parsed", None)  # the header, parsed while reading (disk)
            return codec.decode(
                data, verify=self.verifies_checksum, payload_checksum=digest, parsed=parsed, basis_source=self.get_blob
            )
        except CorruptSegmentError as e:
            log.warning("%s store: entry %s is corrupt (%s); treated as a miss and removed", self.scheme, key, e)
            self.num_corrupt += 1
            self.remove(key)
        except ModelMismatchError as e:
            log.warning("%s store: entry %s is unreadable (%s); treated as a miss", self.scheme, key, e)
        return None

    verifies_checksum = True  # the memory store skips it: its bytes never leave the process

    def get(self, key: str) -> KVSegment | None:
        """The segment under ``key``, or None (miss, or corrupt entry)."""
        data = self.read(check_key(key))
        segment = None if data is None else self.decode_or_discard(key, data)
        with self.lock:
            if segment is None:
                self.misses += 1
            else:
                self.hits += 1
        return segment

    def put(self, key: str, segment: KVSegment, quant: str | None = None) -> None:
        """Store ``segment`` under ``key`` (replacing any entry), encoded with ``quant`` (None: this store's own;
        ``"none"``: full precision)."""
        quant = self.quant if quant is None else quant
        basis = basis_for_put(self, segment, quant)  # kvtc: its basis kept as a blob of this store
        self.write_parts(check_key(key), codec.encode_parts(segment, quant, basis=basis))

    def contains(self, key: str) -> bool:
        """Whether ``key`` is held (does not count as a use, nor check integrity)."""
        return self.has(check_key(key))

    def delete(self, key: str) -> None:
        self.remove(check_key(key))

    def keys(self) -> list[str]:
        return self.list_keys("seg")

    def describe(self, key: str) -> dict[str, Any] | None:
        """A summary of the entry (tokens, bytes, model, press, quant) read from its header, or None."""
        try:
            header = self.read_header(check_key(key))
        except (CorruptSegmentError, ModelMismatchError) as e:
            log.warning("%s store: entry %s has an unreadable header (%s)", self.scheme, key, e)
            return None
        return None if header is None else codec.summarize(header, self.stored_size(key))

    def stored_size(self, key: str) -> int | None:
        data = self.read(key)
        return None if data is None else len(data)

    def stats(self, deep: bool = False) -> dict[str, Any]:
        """Counters of this process (hits, misses, evictions, corrupt) and the backend's usage.

        With ``deep=True`` every header is read to add tokens, uncompressed bytes and per-model counts.
        """
        out: dict[str, Any] = {
            "backend": self.scheme,
            **self.usage(),
            "quant": self.quant,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.num_evicted,
            "corrupt": self.num_corrupt,
        }
        total = self.hits + self.misses
        out["hit_rate"] = self.hits / total if total else None
        out["usage_ratio"] = out["bytes"] / out["capacity"] if out.get("capacity") else None
        if deep:
            out |= summarize_entries([d for k in self.keys() if (d := self.describe(k)) is not None])
        return out

    def clear(self) -> None:
        """Remove every segment and blob of this store (foreign data is left alone)."""
        for kind in ("seg", "blob"):
            for key in self.list_keys(kind):  # type: ignore[arg-type]
                self.remove(key, kind)  # type: ignore[arg-type]

    def put_blob(self, key: str, data: bytes) -> None:
        self.write(check_key(key), wrap_blob(data), "blob")

    def get_blob(self, key: str) -> bytes | None:
        raw = self.read(check_key(key), "blob")
        if raw is None:
            return None
        try:
            return unwrap_blob(raw)
        except CorruptSegmentError as e:
            log.warning("%s store: blob %s is corrupt (%s); treated as missing and removed", self.scheme, key, e)
            self.remove(key, "blob")
            return None

    def delete_blob(self, key: str) -> None:
        self.remove(check_key(key), "blob")

    def blob_keys(self) -> list[str]:
        return self.list_keys("blob")

    def __enter__(self) -> ByteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def summarize_entries(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over segment summaries: tokens, stored vs uncompressed bytes, entries per model / press / quant."""
    stored = sum(s.get("stored_bytes") or 0 for s in summaries)
    full = sum(s.get("full_bytes") or 0 for s in summaries)
    by_model: dict[str, int] = {}
    by_press: dict[str, int] = {}
    by_quant: dict[str, int] = {}
    for s in summaries:
        by_model[str(s.get("model_id") or "?")] = by_model.get(str(s.get("model_id") or "?"), 0) + 1
        press = s.get("press")
        press_name = "none" if not press else str(press.get("name", press) if isinstance(press, dict) else press)
        by_press[press_name] = by_press.get(press_name, 0) + 1
        by_quant[str(s.get("quant") or "none")] = by_quant.get(str(s.get("quant") or "none"), 0) + 1
    return {
        "tokens": sum(s.get("num_tokens") or 0 for s in summaries),
        "stored_bytes": stored,
        "full_bytes": full,
        "stored_ratio": stored / full if full else None,
        "by_model": by_model,
        "by_press": by_press,
        "by_quant": by_quant,
    }


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str | int) -> int:
    """``"512MB"`` -> 512_000_000, ``"2GiB"`` -> 2 * 1024**3, ``"1e6"`` -> 1_000_000."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: use bytes or a unit (KB, MB, GB, KiB, MiB, GiB)")
    try:
        value = float(m.group(1)) * _SIZE_UNITS[unit]
    except ValueError as e:
        raise ValueError(f"invalid size {text!r}") from e
    if not 0 <= value < 2**63:
        raise ValueError(f"invalid size {text!r}: out of range")
    return int(value)
