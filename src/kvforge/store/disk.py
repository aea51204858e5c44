"""``file:///path?max_bytes=N``: one file per entry, atomic writes, LRU eviction by bytes, survives restarts.

Layout under the root folder::

    segments/<shard>/<key>.kvseg     encoded segments (their mtime is the last use, for LRU); <shard> = two hex digits
                                     of a hash of the key (256 folders), so keys sharing a start still spread out
    blobs/<key>.blob                 opaque blobs (reuse indexes), never evicted
    tmp/                             files being written (tmp + fsync + rename: a reader never sees a partial entry)

The in-memory LRU index is rebuilt from the files on open (ordered by mtime) and re-synced from the folder when an
eviction is due, so several processes can share one folder. Files that do not follow the layout are ignored. Folders
are made by the first write, never by opening: looking into a store (``kvforge cache ls``) creates nothing.

Errors: every method raises what the file system raises (a read-only mount, a full disk, a quota, ``ulimit -f``,
permissions...) after cleaning up after itself (a failed write leaves no file; the cleanup never raises a second
error); :class:`~kvforge.store.base.ByteStore` turns them into misses and skipped writes, with one warning per cause.

Stores written by kvforge before the hashed layout kept segments in ``segments/<key[:2]>/``: such files are moved into
their hashed folder when a writable store scans the folder (on open, and on each re-scan, so a straggler written by an
older process moves too); a read-only store reads them where they are.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import stat
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.errors import UserError
from kvforge.store import buffers, codec
from kvforge.store.base import _KEY_RE, ByteStore, ClearResult, Kind, check_key, usage_report

log = logging.getLogger(__name__)

DEFAULT_DISK_BYTES = 10 * 1024**3
SEG_SUFFIX, BLOB_SUFFIX, TMP_SUFFIX = ".kvseg", ".blob", ".tmp"
WRITES_MARK = ".writes"  # in segments/: its mtime changes with every committed entry (see DiskStore._make_room)
MAX_BLOB_BYTES = 256 << 20  # a blob (reuse indexes, KV bases) larger than this and than max_bytes is not read
STALE_TMP_S = 3600.0  # a tmp file older than this is a crashed write: removed on open
READ_CHUNK = 512 << 10  # read and hashed at once, while in the CPU's cache (a helper thread hashing 8 MiB chunks
# behind the read was slower once reads fill recycled memory, and needs a free core: see docs/store.md)


class SegmentBytes(np.ndarray):
    """The bytes of a segment file (uint8, writable: decoded tensors are views into it), with what was learnt while
    reading them: ``payload_checksum``, ``(offset, digest)`` of the bytes after the header, and ``parsed``, the
    header as :func:`codec.payload_hasher` parsed it (both None when the header could not be parsed: decode checks)."""

    payload_checksum: tuple[int, str] | None = None
    parsed: codec.Parsed | None = None


def _read_hashing(f: Any, buf: memoryview) -> tuple[int, codec.Parsed | None, tuple[int, str] | None]:
    """Fill ``buf`` from ``f`` in chunks, hashing what follows the segment's header as it arrives under the algorithm
    the header names; (bytes read, parsed header, (offset, digest)); both None when anything in the header is odd
    (decode then parses and checks it again), and then the read stops there: a file whose header is garbage or
    declares another size is not read whole. Each chunk is hashed right after it is read, while it is in cache."""
    n, start, h, parsed = 0, 0, None, None
    while n < len(buf):
        got = f.readinto(buf[n : n + READ_CHUNK])
        if not got:
            break
        if h is not None:
            h.update(buf[n : n + got])
        n += got
        if h is None:
            try:
                if not start and n >= 16:
                    start = codec.header_size(buf[:16])
                if start and n >= start:
                    parsed, h = codec.payload_hasher(buf[:start])
                    if start + int(parsed.header["payload_bytes"]) != len(buf):
                        raise ValueError("the header does not describe this file")
                    h.update(buf[start:n])
            except Exception:  # garbage or a header of another size: the rest is not read (decode reports it)
                return n, None, None
    return n, parsed, None if h is None else (start, str(h.hexdigest()))


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    """The entries of ``folder`` (none when it is missing, unreadable or not a folder)."""
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError:
        return []


def shard(key: str) -> str:
    """The folder of a segment under ``segments/``: two hex digits of a hash of the key (256 folders)."""
    return hashlib.blake2b(key.encode(), digest_size=1).hexdigest()


def _discard(path: Path) -> None:
    """Remove ``path`` if it is there: a cleanup, which never raises (on a read-only or vanished folder it does
    nothing; the error being cleaned up after is the one reported)."""
    with contextlib.suppress(OSError):
        path.unlink()


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: Path) -> Any:
    """``path`` opened for reading only if it is a regular file inside a real folder (no symlink as the file or its
    folder, no FIFO, device or socket: opened non-blocking and checked before a byte is read, so a FIFO cannot hang
    the reader). Raises FileNotFoundError when absent, :class:`ForeignEntryError` for anything else."""
    if path.parent.is_symlink():
        raise ForeignEntryError(f"{path.parent.name}/ is a symbolic link")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ForeignEntryError("a symbolic link") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ForeignEntryError("not a regular file")
    os.set_blocking(fd, True)
    return open(fd, "rb", buffering=0)


class ForeignEntryError(OSError):
    """Something at an entry's path that kvforge did not write (a link, a FIFO, a device): never followed nor read,
    never removed; a miss with one warning."""

    def __init__(self, what: str) -> None:
        super().__init__(errno.EINVAL, f"not a store entry ({what})")


class EntryTooLargeError(OSError):
    """A file larger than ``max_bytes`` at an entry's path (a blob: than :data:`MAX_BLOB_BYTES` too): not read (a miss
    with one warning), left in place."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(errno.EFBIG, f"entry of {size} bytes is over its bound of {limit} bytes; not read")


class DiskStore(ByteStore):
    """Entries as files under ``root``, least recently used evicted past ``max_bytes``.

    Args:
        root: folder (created by the first write if missing).
        max_bytes: bound on the bytes of segment files plus the partial writes in ``tmp/`` (a writer killed mid-write
            leaves one; it counts until it is removed, by age, when a store opens the folder). Blobs are not counted.
        fsync: fsync each file and its folder before the write returns (durable across power loss).
        quant: optional int8 quantisation of stored segments.
        rescan_s: on a write, re-read the folder's listing when the last scan is older than this, so files written
            by other processes count against ``max_bytes`` (it is always re-read before evicting).
        read_only: serve hits, never write nor remove (``?read_only=1``). A folder that refuses writes without it (a
            read-only mount, another user's folder, a full disk) serves hits too: each write is tried, and skipped
            with one warning per cause.
    """

    scheme = "file"

    def __init__(
        self,
        root: str | Path,
        max_bytes: int = DEFAULT_DISK_BYTES,
        fsync: bool = True,
        quant: str | None = None,
        rescan_s: float = 1.0,
        read_only: bool = False,
    ) -> None:
        super().__init__(quant)
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.root = Path(root).expanduser()
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.rescan_s = rescan_s
        self._last_scan = 0.0
        self._last_ns = 0
        self._seen_writes: int | None = None
        self._legacy: set[str] = set()  # keys still in the pre-hash layout (a read-only store cannot move them)
        self.read_only = read_only
        if read_only and not self.root.is_dir():
            raise UserError(f"read-only disk store {self.root} does not exist")
        existing = next((p for p in (self.root, *self.root.parents) if p.exists()), self.root)
        if not existing.is_dir():  # e.g. a path under a file: no write could ever succeed
            raise UserError(f"cannot use {self.root} as a disk store: {existing} is not a folder")
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self._bytes = 0
        self._tmp_bytes = 0  # partial writes (other processes' in flight, or left by a killed writer)
        self._remove_stale_tmp()
        self._rescan()

    # ------------------------------------------------------------------------------------------ paths, index
    def path(self, key: str, kind: Kind = "seg") -> Path:
        """Where the entry ``key`` lives (every method goes through here: the key is validated)."""
        check_key(key)
        if kind == "blob":
            return self.root / "blobs" / f"{key}{BLOB_SUFFIX}"
        if key in self._legacy:
            return self._legacy_path(key)
        return self.root / "segments" / shard(key) / f"{key}{SEG_SUFFIX}"

    def _legacy_path(self, key: str) -> Path:
        return self.root / "segments" / key[:2] / f"{key}{SEG_SUFFIX}"

    def _scan(self, kind: Kind) -> list[tuple[int, str, int]]:
        """(mtime, key, size) of the files of ``kind`` on disk, foreign files skipped, old-layout files migrated.
        Only regular files in real folders count: links (to files or shard folders), FIFOs and devices are neither
        followed, listed, moved nor removed."""
        found: dict[str, tuple[int, str, int]] = {}
        suffix = SEG_SUFFIX if kind == "seg" else BLOB_SUFFIX
        top = self.root / ("segments" if kind == "seg" else "blobs")
        folders = [e.path for e in _entries(top) if e.is_dir(follow_symlinks=False)] if kind == "seg" else [top]
        for folder in folders:
            for entry in _entries(Path(folder)):
                if not entry.name.endswith(suffix) or not entry.is_file(follow_symlinks=False):
                    continue
                p = Path(entry.path)
                key = entry.name[: -len(suffix)]
                if not _KEY_RE.match(key):
                    continue
                home = kind == "blob" or p.parent.name == shard(key)
                if not home:
                    if p.parent.name != key[:2]:
                        continue  # not ours
                    moved = self._migrate(key, p)
                    if moved is None:
                        continue
                    p, home = moved, moved != p
                elif kind == "seg":
                    self._legacy.discard(key)  # the hashed copy is the one to use
                if key in found and not home:
                    continue
                try:
                    st = p.lstat()
                except FileNotFoundError:  # removed meanwhile by another process
                    continue
                found[key] = (st.st_mtime_ns, key, st.st_size)
        return list(found.values())

    def _migrate(self, key: str, old: Path) -> Path | None:
        """Move a segment of the pre-hash layout into its hashed folder; the path to use, or None if it is gone."""
        new = self.root / "segments" / shard(key) / f"{key}{SEG_SUFFIX}"
        if self.read_only:
            if new.is_file():
                return None  # the hashed copy wins
            self._legacy.add(key)
            return old
        if new.parent.is_symlink():
            return None  # its hashed folder links out of the store: not moved there
        try:
            if new.is_file():
                old.unlink()  # written again since, under the new layout: that copy is the current one
                return None
            new.parent.mkdir(exist_ok=True)
            os.replace(old, new)  # keeps the mtime: the LRU order survives the move
        except FileNotFoundError:  # moved or removed meanwhile by another process
            return new if new.is_file() else None
        except OSError as e:  # a read-only mount, a full disk...: read in place
            if not self._legacy:
                log.warning("disk store: could not move %s into the hashed layout (%s); read in place", old, e.strerror)
            self._legacy.add(key)
            return old
        self._legacy.discard(key)
        log.debug("disk store: moved %s into the hashed layout", key)
        return new

    def _rescan(self) -> None:
        """Rebuild the LRU index from the files (oldest mtime first)."""
        with self.lock:
            self._seen_writes = self._writes_mark()  # before listing: a write committed meanwhile shows next time
            self._index = OrderedDict((key, size) for _, key, size in sorted(self._scan("seg")))
            self._bytes = sum(self._index.values())
            self._tmp_bytes = self._scan_tmp_bytes()
            self._last_scan = time.monotonic()

    def _scan_tmp_bytes(self) -> int:
        total = 0
        for p in self._tmp_files():
            with contextlib.suppress(FileNotFoundError):
                total += p.lstat().st_size
        return total

    def _tmp_files(self) -> list[Path]:
        """Partial writes in ``tmp/`` (regular files only: a link there is not followed, counted nor removed)."""
        return [Path(e.path) for e in _entries(self.root / "tmp")
                if e.name.endswith(TMP_SUFFIX) and e.is_file(follow_symlinks=False)]  # fmt: skip

    @property
    def display(self) -> str:
        return str(self.root)

    def _remove_stale_tmp(self) -> None:
        if self.read_only:
            return
        now = time.time()
        for p in self._tmp_files():
            with contextlib.suppress(OSError):
                if now - p.lstat().st_mtime > STALE_TMP_S:
                    p.unlink()
                    log.info("disk store: removed a leftover partial write %s", p.name)

    # ------------------------------------------------------------------------------------------ raw bytes
    def read(self, key: str, kind: Kind = "seg") -> SegmentBytes | memoryview | None:
        path = self.path(key, kind)
        try:
            with open_regular(path) as f:
                size = os.fstat(f.fileno()).st_size
                limit = self.max_bytes if kind == "seg" else max(self.max_bytes, MAX_BLOB_BYTES)
                if size > limit:  # no entry this store (or a writer with its bound) makes is this large
                    raise EntryTooLargeError(size, limit)
                if kind == "blob":
                    blob = np.empty(size, dtype=np.uint8)  # uninitialised (no zeroing pass) and writable
                    n = 0
                    while n < size and (got := f.readinto(blob.data[n:])):
                        n += got
                    return blob.data[:n]
                # uninitialised and writable: decoded tensors are views into it, so the file's bytes are copied
                # once, by the read itself; memory of an earlier read when nothing refers to it any more (half the
                # cost of fresh memory, whose pages must be faulted in and zeroed)
                buf = buffers.take(size, SegmentBytes)
                n, parsed, digest = _read_hashing(f, buf.data)
        except FileNotFoundError:
            if kind == "seg":
                self._forget(key)
            return None
        data = buf[:n]
        data.payload_checksum, data.parsed = digest, parsed
        with contextlib.suppress(OSError):  # gone meanwhile, or a read-only folder: the hit still counts
            self._stamp(path)  # the mtime is the last use: the LRU order survives restarts
        with self.lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:  # written by another process
                self._index[key] = size
                self._bytes += size
        return data

    def write(self, key: str, data: bytes, kind: Kind = "seg") -> bool:
        return self.write_parts(key, [data], kind)

    def write_parts(self, key: str, parts: list[bytes | memoryview], kind: Kind = "seg") -> bool:
        check_key(key)
        size = sum(memoryview(p).nbytes for p in parts)
        if self.read_only:
            return False
        if kind == "seg" and size > self.max_bytes:
            log.warning("disk store: entry %s (%d bytes) exceeds max_bytes=%d; not stored", key, size, self.max_bytes)
            return False
        path = self.root / "segments" / shard(key) / f"{key}{SEG_SUFFIX}" if kind == "seg" else self.path(key, kind)
        tmp = self.root / "tmp" / f"{key}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            for folder in (tmp.parent, path.parent):  # made by the first write (opening a store creates nothing)
                if not folder.is_dir():
                    folder.mkdir(parents=True, exist_ok=True)
                if folder.is_symlink():  # a write through it would land outside the store
                    raise ForeignEntryError(f"{folder.name}/ is a symbolic link")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with open(fd, "wb") as f:
                if kind == "seg":  # room first: the bytes about to be written count before they are on disk
                    f.truncate(size)  # (sparse) the entry's size, seen by every writer that scans tmp/ from now on
                    self._make_room(size)
                for part in parts:
                    f.write(part)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            self._stamp(tmp)
            if kind == "seg":
                self._mark_write()
            os.replace(tmp, path)  # atomic: readers see the old file or the new one
        except BaseException:
            _discard(tmp)  # whatever failed (EROFS, ENOSPC, EFBIG, EDQUOT, EACCES, an interrupt): no partial file
            raise
        if self.fsync:
            self._fsync_dir(path.parent)
        if kind == "seg":
            with self.lock:
                self._legacy.discard(key)  # written under the hashed layout now
                self._forget(key)
                self._index[key] = size
                self._bytes += size
            self._evict(keep=key)
        return True

    def _writes_mark(self) -> int | None:
        """The mtime of ``segments/.writes`` (None: no write committed yet)."""
        try:
            return (self.root / "segments" / WRITES_MARK).lstat().st_mtime_ns
        except OSError:
            return None

    def _mark_write(self) -> None:
        """Tell the processes sharing the folder that an entry is being committed (before it is: see _make_room)."""
        mark = self.root / "segments" / WRITES_MARK
        with self.lock:
            before = self._writes_mark()
            mark.touch()
            self._stamp(mark)
            if before == self._seen_writes:  # nobody else committed since our last listing: ours needs none
                self._seen_writes = self._writes_mark()

    def _stamp(self, path: Path) -> None:
        """Set the mtime to now with ns precision, strictly increasing in this process (the kernel's own file
        timestamps tick per jiffy: entries used within one tick would tie)."""
        with self.lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            os.utime(path, ns=(self._last_ns, self._last_ns))

    @staticmethod
    def _fsync_dir(folder: Path) -> None:
        with contextlib.suppress(OSError):  # not supported everywhere (e.g. Windows)
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _forget(self, key: str) -> None:
        with self.lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def _make_room(self, size: int) -> None:
        """Before a write of ``size`` bytes (already reserved as a sparse file in ``tmp/``): evict least recently used
        entries until the entries plus every partial write fit ``max_bytes``. Partial writes are listed afresh (a
        small folder); entries when another process committed one since the last listing (the mtime of
        ``segments/.writes``, which every writer sets just before each commit), so writers sharing the folder count
        each other's entries and writes in flight, and a lone writer lists nothing."""
        with self.lock:
            self._tmp_bytes = self._scan_tmp_bytes()  # first: a write committed after this bumps the mark below
            if self._writes_mark() != self._seen_writes or time.monotonic() - self._last_scan > self.rescan_s:
                self._rescan()  # another process committed an entry since the last listing: count it
            while self._bytes + self._tmp_bytes > self.max_bytes and self._index:
                old = next(iter(self._index))
                self._forget(old)
                self.discard(old)
                self.num_evicted += 1
                log.debug("disk store: evicted %s to make room for a write of %d bytes", old, size)

    def _evict(self, keep: str) -> None:
        """Remove least recently used segment files until the folder holds at most ``max_bytes``."""
        with self.lock:
            is_stale = time.monotonic() - self._last_scan > self.rescan_s
            if is_stale:
                self._rescan()  # other processes may have written entries
            if self._bytes + self._tmp_bytes <= self.max_bytes:
                return
            if not is_stale:
                self._rescan()  # ... or used them: take the LRU order from the files' mtimes
            if keep in self._index:
                self._index.move_to_end(keep)
            while self._bytes + self._tmp_bytes > self.max_bytes and len(self._index) > 1:
                old = next(iter(self._index))
                self._forget(old)  # an entry that cannot be removed is not tried again by this eviction
                self.discard(old)
                self.num_evicted += 1
                log.debug("disk store: evicted %s", old)

    def remove(self, key: str, kind: Kind = "seg") -> None:
        if self.read_only:
            raise OSError(errno.EROFS, "the store was opened read-only (?read_only=1)", str(self.root))
        path = self.path(key, kind)
        if path.parent.is_symlink():
            raise ForeignEntryError(f"{path.parent.name}/ is a symbolic link")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a link itself (never its target), written over a file of ours by someone else
        if kind == "seg":
            self._forget(key)

    def has(self, key: str, kind: Kind = "seg") -> bool:
        path = self.path(key, kind)
        try:
            return stat.S_ISREG(path.lstat().st_mode) and not path.parent.is_symlink()
        except FileNotFoundError:
            return False

    def list_keys(self, kind: Kind = "seg") -> list[str]:
        if kind == "blob":
            return sorted(key for _, key, _ in self._scan("blob"))
        self._rescan()
        with self.lock:
            return list(self._index)

    def read_header(self, key: str) -> dict[str, Any] | None:
        try:
            with open_regular(self.path(key)) as f:  # no mtime update: describing is not using
                prefix = f.read(16)
                size = os.fstat(f.fileno()).st_size
                rest = f.read(min(max(codec.header_size(prefix) - len(prefix), 0), size))
        except FileNotFoundError:
            return None
        return codec.read_header(prefix + rest)

    def stored_size_raw(self, key: str) -> int | None:
        try:
            return self.path(key).lstat().st_size
        except FileNotFoundError:
            return None

    def touch(self, key: str) -> None:
        check_key(key)
        with contextlib.suppress(OSError):  # gone, or a read-only folder (no LRU stamp then)
            self._stamp(self.path(key))
            with self.lock:
                if key in self._index:
                    self._index.move_to_end(key)

    def clear(self) -> ClearResult:
        result = super().clear()
        self._remove_stale_tmp()
        return result

    def usage(self) -> dict[str, Any]:
        self._rescan()
        blobs = self._scan("blob")
        tmp_files = len(self._tmp_files())
        with self.lock:
            url = f"file://{self.root.resolve()}?max_bytes={self.max_bytes}"
            return usage_report(url, len(self._index), self._bytes, self.max_bytes, (size for _, _, size in blobs),
                                tmp_files=tmp_files, tmp_bytes=self._tmp_bytes)  # fmt: skip
