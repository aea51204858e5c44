"""The KVStore protocol and the shared machinery of the byte-oriented backends (memory, disk, Redis).

A backend only moves bytes (``read``/``write``/``remove``/``list_keys``); :class:`ByteStore` turns them into the
:class:`KVStore` protocol through :mod:`kvforge.store.codec`: a corrupt entry is a miss with a warning (and is
removed), never an exception or wrong KV. Blobs are opaque bytes (the reuse layer's index files) wrapped with a
checksum; they are never evicted and do not count against ``max_bytes``.

One rule for I/O errors, applied here and nowhere else (:meth:`ByteStore._io`): whatever a backend raises for I/O
(any ``OSError`` — read-only mount, full disk, quota, file-size limit, permissions, EIO... — or an unreachable store)
makes a read a miss and a write a skipped write, with ONE warning per cause (operation + errno or error type) until
that operation succeeds again; a file-size limit (EFBIG) is a limit on an entry's size, which a smaller entry that fits
does not lift, so it is warned about once per store. Only :meth:`ByteStore.clear` reports failures instead: it returns
what it could and could not remove. :func:`track_writes` tells a caller whether the writes of a block of work were kept.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from kvforge.errors import CorruptSegmentError, ModelMismatchError, StoreUnavailableError
from kvforge.names import STORE_KEY_PATTERN
from kvforge.redact import redact_text
from kvforge.store import codec
from kvforge.store.quant import canonical_quant
from kvforge.store.transform import basis_for_put
from kvforge.types import KVSegment

log = logging.getLogger(__name__)

Kind = Literal["seg", "blob"]
Op = Literal["read", "write", "remove"]
_KEY_RE = re.compile(STORE_KEY_PATTERN)
_BLOB_MAGIC = b"KVFBLOB1"
_T = TypeVar("_T")


@dataclass
class ClearResult:
    """What :meth:`KVStore.clear` really did: entries (segments and blobs) removed, and those it could not remove
    (key -> reason, e.g. ``Read-only file system [EROFS]``)."""

    removed: int = 0
    failed: dict[str, str] = field(default_factory=dict)

    def __iadd__(self, other: ClearResult) -> ClearResult:
        self.removed += other.removed
        self.failed |= other.failed
        return self


@dataclass
class WriteLog:
    """The writes made inside one :func:`track_writes` block: keys kept by at least one store, keys not kept."""

    stored: set[str] = field(default_factory=set)
    skipped: dict[str, str] = field(default_factory=dict)  # key -> why

    @property
    def lost(self) -> dict[str, str]:
        """Keys that no store kept (a tiered store keeps a key when any tier does)."""
        return {k: why for k, why in self.skipped.items() if k not in self.stored}


_WRITES: contextvars.ContextVar[WriteLog | None] = contextvars.ContextVar("kvforge_store_writes", default=None)


@contextlib.contextmanager
def track_writes() -> Iterator[WriteLog]:
    """Record the outcome of every store write made by this thread inside the block (e.g. to answer "was the
    document stored?" honestly); nested blocks each see their own writes."""
    log_ = WriteLog()
    token = _WRITES.set(log_)
    try:
        yield log_
    finally:
        _WRITES.reset(token)


def _note_write(key: str, why_not: str | None) -> None:
    current = _WRITES.get()
    if current is None:
        return
    if why_not is None:
        current.stored.add(key)
    else:
        current.skipped.setdefault(key, why_not)


def describe_error(e: BaseException) -> str:
    """One line naming an I/O error without secrets: ``No space left on device [ENOSPC]``, or the error's text."""
    if isinstance(e, OSError) and e.errno is not None:
        return f"{e.strerror or 'error'} [{errno.errorcode.get(e.errno, e.errno)}]"
    return redact_text(str(e).splitlines()[0] if str(e) else type(e).__name__)


# causes that depend on the entry written, not on the store's state: a write that succeeds does not heal them
SIZE_CAUSES = frozenset({"EFBIG"})


def _cause(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return errno.errorcode.get(e.errno, str(e.errno))
    return type(e).__name__


@runtime_checkable
class KVStore(Protocol):
    """Where KV segments live, addressed by caller-chosen keys (hex digests)."""

    def get(self, key: str) -> KVSegment | None: ...  # None on miss, and on a corrupt entry (with a warning)
    def put(self, key: str, segment: KVSegment, quant: str | None = None) -> None: ...  # quant: None = the store's
    def contains(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def keys(self) -> list[str]: ...
    def stats(self) -> dict: ...  # entries, bytes, capacity, hits, misses (per tier for a tiered store)
    def clear(self) -> ClearResult: ...  # what was removed, and what could not be
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

    Backends raise on I/O errors; every protocol method goes through :meth:`_io`, the one place that turns them into
    misses and skipped writes (see the module docstring).

    Args:
        quant: optional int8 quantisation applied when encoding (``int8-channel``, ``int8-token``, ``int8-kivi``).
    """

    scheme = ""
    # what a backend raises for I/O; a backend adds its client's errors (the Redis store: redis-py's)
    io_errors: tuple[type[BaseException], ...] = (OSError, StoreUnavailableError)
    retry_s = 0.0  # after a StoreUnavailableError, answer at once (miss / skipped) for this long before asking again

    def __init__(self, quant: str | None = None) -> None:
        self.quant = check_quant(quant)
        self.hits = 0
        self.misses = 0
        self.num_corrupt = 0
        self.num_evicted = 0
        self.num_faults = 0  # reads answered as misses and writes skipped because of an I/O error
        self.lock = threading.RLock()
        self._faults: dict[tuple[str, str], int] = {}  # (op, cause) -> failures since that op last succeeded
        self._down_at: float | None = None  # when the store was last found unreachable

    @property
    def display(self) -> str:
        """How messages name this store (never with a secret)."""
        return self.scheme

    # ------------------------------------------------------------------------ the one rule for I/O errors
    def _io(self, op: Op, key: str, fn: Callable[[], _T], default: _T) -> _T:
        """``fn()``; on an I/O error ``default`` (a miss, a skipped write), with ONE warning per (op, cause) until
        ``op`` succeeds again. After an unreachable store, later calls answer ``default`` at once for ``retry_s``."""
        if self._down_at is not None and time.monotonic() < self._down_at + self.retry_s:
            if op == "write":
                _note_write(key, "store unavailable")
            return default
        try:
            out = fn()
        except self.io_errors as e:
            self._fault(op, key, e)
            if op == "write":
                _note_write(key, describe_error(e))
            return default
        self._healthy(op)
        return out

    def _fault(self, op: Op, key: str, e: BaseException) -> None:
        cause = (op, _cause(e))
        with self.lock:
            self.num_faults += 1
            first = cause not in self._faults
            self._faults[cause] = self._faults.get(cause, 0) + 1
            if isinstance(e, StoreUnavailableError):
                self._down_at = time.monotonic()
        outcome = {"read": "treated as a miss", "write": "not stored", "remove": "left in place"}[op]
        (log.warning if first else log.debug)(
            "%s store %s: %s of %s failed (%s); %s%s",
            self.scheme,
            self.display,
            op,
            key,
            describe_error(e),
            outcome,
            (
                ""
                if not first
                else " (entries this large are not logged again)"
                if cause[1] in SIZE_CAUSES
                else f" (the same failure is not logged again until a {op} succeeds)"
            ),
        )

    def _healthy(self, op: Op) -> None:
        if not self._faults:
            return
        with self.lock:
            healed = [c for c in self._faults
                      if (c[0] == op and c[1] not in SIZE_CAUSES) or c[1] == "StoreUnavailableError"]  # fmt: skip
            for c in healed:
                del self._faults[c]
            self._down_at = None
        if healed:
            back = any(c[1] == "StoreUnavailableError" for c in healed)
            news = "available again" if back else f"{op}s succeed again"
            log.warning("%s store %s: %s", self.scheme, self.display, news)

    def mark_unavailable(self, e: StoreUnavailableError) -> None:
        """Record an outage found outside the protocol (a failed ping): it counts as this cause's one warning for every
        operation, so the caller's own warning is the only one."""
        with self.lock:
            for op in ("read", "write", "remove"):
                self._faults.setdefault((op, _cause(e)), 0)
            self._down_at = time.monotonic()

    def load(self, key: str, kind: Kind = "seg") -> bytes | bytearray | memoryview | None:
        """The stored bytes under the I/O rule (None on a miss or an I/O error)."""
        check_key(key)
        return self._io("read", key, lambda: self.read(key, kind), None)

    def save(self, key: str, parts: list[bytes | memoryview], kind: Kind = "seg") -> bool:
        """Store ``parts`` under the I/O rule; whether they were stored (False: an I/O error, with the rule's
        warning, or the backend declined: an entry over ``max_bytes``, a store opened read-only)."""
        check_key(key)
        outcome = self._io("write", key, lambda: self.write_parts(key, parts, kind) is not False, None)
        if outcome is None:
            return False  # an I/O error: noted by _io
        _note_write(key, None if outcome else "declined by the store (over max_bytes, or opened read-only)")
        return outcome

    def discard(self, key: str, kind: Kind = "seg") -> None:
        """Remove under the I/O rule (a failure is a warning; the entry stays)."""
        check_key(key)
        self._io("remove", key, lambda: self.remove(key, kind), None)

    # ------------------------------------------------------------------------ raw bytes (backends implement)
    @abstractmethod
    def read(self, key: str, kind: Kind = "seg") -> bytes | bytearray | memoryview | None:
        """The stored bytes, or None; a segment read counts as a use for LRU. Raises on I/O errors."""

    @abstractmethod
    def write(self, key: str, data: bytes, kind: Kind = "seg") -> bool | None:
        """Store bytes (atomically: a reader sees the old entry, the new one, or none); False when the backend
        declines (entry over ``max_bytes``, opened read-only). Raises on I/O errors, leaving nothing behind."""

    def write_parts(self, key: str, parts: list[bytes | memoryview], kind: Kind = "seg") -> bool | None:
        """Store the concatenation of ``parts`` (backends that stream override this to skip the join)."""
        return self.write(key, b"".join(parts), kind)

    @abstractmethod
    def remove(self, key: str, kind: Kind = "seg") -> None:
        """Drop an entry if present. Raises on I/O errors."""

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
        self.load(key)

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
            self.discard(key)
        except ModelMismatchError as e:
            log.warning("%s store: entry %s is unreadable (%s); treated as a miss", self.scheme, key, e)
        return None

    verifies_checksum = True  # the memory store skips it: its bytes never leave the process

    def get(self, key: str) -> KVSegment | None:
        """The segment under ``key``, or None (miss, corrupt entry, or an I/O error)."""
        data = self.load(key)
        segment = None if data is None else self.decode_or_discard(key, data)
        with self.lock:
            if segment is None:
                self.misses += 1
            else:
                self.hits += 1
        return segment

    def put(self, key: str, segment: KVSegment, quant: str | None = None) -> None:
        """Store ``segment`` under ``key`` (replacing any entry), encoded with ``quant`` (None: this store's own;
        ``"none"``: full precision). An I/O error skips the write (one warning per cause)."""
        quant = self.quant if quant is None else quant
        basis = basis_for_put(self, segment, quant)  # kvtc: its basis kept as a blob of this store
        self.save(check_key(key), codec.encode_parts(segment, quant, basis=basis))

    def contains(self, key: str) -> bool:
        """Whether ``key`` is held (does not count as a use, nor check integrity)."""
        check_key(key)
        return self._io("read", key, lambda: self.has(key), False)

    def delete(self, key: str) -> None:
        self.discard(key)

    def keys(self) -> list[str]:
        return self._io("read", "(listing)", lambda: self.list_keys("seg"), [])

    def describe(self, key: str) -> dict[str, Any] | None:
        """A summary of the entry (tokens, bytes, model, press, quant) read from its header, or None."""
        check_key(key)

        def summary() -> dict[str, Any] | None:
            try:
                header = self.read_header(key)
            except (CorruptSegmentError, ModelMismatchError) as e:
                log.warning("%s store: entry %s has an unreadable header (%s)", self.scheme, key, e)
                return None
            return None if header is None else codec.summarize(header, self.stored_size_raw(key))

        return self._io("read", key, summary, None)

    def stored_size(self, key: str) -> int | None:
        """Bytes stored under ``key`` (None when absent or unreadable)."""
        check_key(key)
        return self._io("read", key, lambda: self.stored_size_raw(key), None)

    def stored_size_raw(self, key: str) -> int | None:
        data = self.read(key)
        return None if data is None else len(data)

    def stats(self, deep: bool = False) -> dict[str, Any]:
        """Counters of this process (hits, misses, evictions, corrupt, faults) and the backend's usage.

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
            "io_faults": self.num_faults,
        }
        total = self.hits + self.misses
        out["hit_rate"] = self.hits / total if total else None
        out["usage_ratio"] = out["bytes"] / out["capacity"] if out.get("capacity") else None
        if deep:
            out |= summarize_entries([d for k in self.keys() if (d := self.describe(k)) is not None])
        return out

    def clear(self) -> ClearResult:
        """Remove every segment and blob of this store (foreign data is left alone); returns what was removed and
        what could not be (no warning: the caller reports it)."""
        result = ClearResult()
        for kind in ("seg", "blob"):
            for key in self.list_keys(kind):  # type: ignore[arg-type]
                try:
                    self.remove(key, kind)  # type: ignore[arg-type]
                    result.removed += 1
                except self.io_errors as e:
                    result.failed[key] = describe_error(e)
        return result

    def put_blob(self, key: str, data: bytes) -> None:
        self.save(check_key(key), [wrap_blob(data)], "blob")

    def get_blob(self, key: str) -> bytes | None:
        raw = self.load(key, "blob")
        if raw is None:
            return None
        try:
            return unwrap_blob(raw)
        except CorruptSegmentError as e:
            log.warning("%s store: blob %s is corrupt (%s); treated as missing and removed", self.scheme, key, e)
            self.discard(key, "blob")
            return None

    def delete_blob(self, key: str) -> None:
        self.discard(key, "blob")

    def blob_keys(self) -> list[str]:
        return self._io("read", "(listing)", lambda: self.list_keys("blob"), [])

    def __enter__(self) -> ByteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def summarize_entries(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over segment summaries: tokens, stored vs uncompressed bytes, entries per model / press / quant (a
    summary read from a store is input: a count that is not a whole number counts as 0)."""
    stored = sum(_count(s.get("stored_bytes")) for s in summaries)
    full = sum(_count(s.get("full_bytes")) for s in summaries)
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
        "tokens": sum(_count(s.get("num_tokens")) for s in summaries),
        "stored_bytes": stored,
        "full_bytes": full,
        "stored_ratio": stored / full if full else None,
        "by_model": by_model,
        "by_press": by_press,
        "by_quant": by_quant,
    }


def _count(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


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


def usage_report(
    url: str, entries: int, nbytes: int, capacity: int | None, blob_sizes: Iterable[int], **backend: Any
) -> dict[str, Any]:
    """What every store's ``usage()`` says (``url``, ``entries``, ``bytes``, ``capacity``, ``blobs``, ``blob_bytes``),
    then the backend's own facts."""
    sizes = list(blob_sizes)
    common = {"url": url, "entries": entries, "bytes": nbytes, "capacity": capacity, "blobs": len(sizes)}
    return common | {"blob_bytes": sum(sizes)} | backend
