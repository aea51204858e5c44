"""sha256 of model files, read once per version of each file: cached by (path, size, mtime) in kvforge's cache folder.

:func:`kvforge.model.model_fingerprint` keys stored KV by the weights a model was loaded from. Hashing every tensor at
each start costs seconds (about 30 s for an 8B model); the files' digests cost one read per new file version, then a
``stat`` per file. A file that changes gets a new size or mtime, so its digest is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from kvforge.paths import cache_dir

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = ("config.json",)  # what else changes the computation: the architecture's settings


def _entry_path(path: Path) -> Path:
    return cache_dir() / "digests" / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file, from the cache when its size and mtime are those it had when it was hashed."""
    path = Path(path).resolve()
    stat = path.stat()
    key = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    entry = _entry_path(path)
    try:
        cached = json.loads(entry.read_text())
        if {k: cached.get(k) for k in key} == key and isinstance(cached.get("sha256"), str):
            return str(cached["sha256"])
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    digest = h.hexdigest()
    try:  # atomically: concurrent processes write the same content
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(key | {"sha256": digest}, out)
        os.replace(tmp, entry)
    except OSError as e:  # a read-only cache folder: hash again next time
        logger.debug("cannot cache the digest of %s: %s", path, e)
    return digest


def folder_digest(folder: str | os.PathLike[str]) -> str | None:
    """sha256 over the names and digests of a model folder's weight files and ``config.json``; None when the folder
    holds no weight file (the weights then come from elsewhere: hash the tensors instead)."""
    files = sorted(
        p for p in Path(folder).iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in CONFIG_FILES)
    )
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}:{file_sha256(p)};".encode())
    return h.hexdigest()
