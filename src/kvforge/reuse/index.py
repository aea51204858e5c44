"""A FAISS inner-product index over unit vectors (= cosine), with the entries' store keys.

Persistence: ONE small store blob per entry (:func:`record_bytes`), never one blob for the whole index, so writers in
several processes, several server instances and restarts only ever add their own records: nothing is overwritten,
nothing is lost. The in-memory index is the union of the records (rebuilt on open, extended with other writers'
records before each search); a missing or damaged record is rebuilt from its stored segment by
:meth:`kvforge.reuse.semantic.SemanticReuse.reconcile`. The former single-blob format
(``to_bytes``) is still read once to migrate an older store.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvforge.errors import UserError
from kvforge.names import STORE_KEY_PATTERN

logger = logging.getLogger(__name__)

MAGIC = b"KVFSEMIDX1\n"
MAX_DIM = 1 << 16  # no embedder has more dimensions; a larger dim read from a store is garbage
_KEY_RE = re.compile(STORE_KEY_PATTERN)
RECORD_MAGIC = b"KVFSEMREC1\n"


@dataclass
class IndexEntry:
    """What a vector stands for: the store key of its KV, the text embedded and a namespace that must match."""

    key: str
    text: str
    namespace: str = ""


def _faiss() -> Any:
    try:
        import faiss
    except ImportError as e:
        raise UserError("semantic reuse needs faiss: pip install 'kvforge[semantic]' (faiss-cpu)") from e
    return faiss


class SemanticIndex:
    """``IndexIDMap2(IndexFlatIP)``: exact top-k cosine search; entries removable by id (evictions)."""

    def __init__(self, dim: int) -> None:
        faiss = _faiss()
        self.dim = dim
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self.entries: dict[int, IndexEntry] = {}
        self.next_id = 0

    def __len__(self) -> int:
        return len(self.entries)

    def has(self, key: str, text: str) -> bool:
        """Whether ``key`` is indexed with this exact text."""
        return any(e.key == key and e.text == text for e in self.entries.values())

    def add(self, vector: np.ndarray, entry: IndexEntry) -> int:
        """Add one unit vector ``(dim,)``; returns its id (an entry with the same key is replaced)."""
        self.remove([i for i, e in self.entries.items() if e.key == entry.key])
        vid = self.next_id
        self.next_id += 1
        self.index.add_with_ids(np.asarray(vector, dtype=np.float32).reshape(1, self.dim), np.array([vid], np.int64))
        self.entries[vid] = entry
        return vid

    def remove(self, ids: list[int]) -> None:
        if ids:
            self.index.remove_ids(np.asarray(ids, dtype=np.int64))
            for i in ids:
                self.entries.pop(i, None)

    def search(self, vector: np.ndarray, k: int = 8) -> list[tuple[float, int]]:
        """Top ``k`` ``(cosine, id)``, best first."""
        if not self.entries:
            return []
        sims, ids = self.index.search(np.asarray(vector, dtype=np.float32).reshape(1, self.dim), min(k, len(self)))
        return [(float(s), int(i)) for s, i in zip(sims[0], ids[0], strict=True) if i >= 0]

    # ---------------------------------------------------------------------------------------- persistence
    def to_bytes(self) -> bytes:
        header = json.dumps(
            {"dim": self.dim, "next_id": self.next_id, "entries": {str(i): vars(e) for i, e in self.entries.items()}}
        ).encode()
        body = _faiss().serialize_index(self.index).tobytes()
        return MAGIC + len(header).to_bytes(8, "little") + header + body

    @classmethod
    def from_bytes(cls, data: bytes) -> SemanticIndex:
        """The index of :meth:`to_bytes`; ValueError for anything else. The FAISS body reaches FAISS's loader only
        once it is exactly the size the header's entries need (a forged body cannot make it read or allocate more)."""
        if not data.startswith(MAGIC):
            raise ValueError("not a kvforge semantic index blob")
        n = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
        start = len(MAGIC) + 8
        try:
            header = json.loads(data[start : start + n])
            dim, next_id = header["dim"], header["next_id"]
            if type(dim) is not int or not 0 < dim <= MAX_DIM or type(next_id) is not int or next_id < 0:
                raise ValueError(f"dim {str(dim)[:20]}, next_id {str(next_id)[:20]}")
            entries = {int(i): _entry(e) for i, e in header["entries"].items()}
            out = cls(dim)
            body = data[start + n :]
            empty = _faiss().serialize_index(out.index).tobytes()
            if body[:4] != empty[:4] or len(body) != len(empty) + len(entries) * (4 * dim + 8):
                raise ValueError(f"its FAISS body of {len(body)} bytes does not hold {len(entries)} vectors of {dim}")
            out.index = _faiss().deserialize_index(np.frombuffer(body, dtype=np.uint8).copy())
        except ValueError:
            raise
        except Exception as e:  # a malformed header or a body FAISS refuses: not an index
            raise ValueError(f"damaged semantic index ({type(e).__name__}: {e})") from None
        out.entries, out.next_id = entries, next_id
        if out.index.ntotal != len(out.entries):
            raise ValueError(f"index holds {out.index.ntotal} vectors for {len(out.entries)} entries")
        return out


def record_bytes(vector: np.ndarray, entry: IndexEntry) -> bytes:
    """One index entry as a self-contained blob: its unit vector (float32, base64) and what it stands for."""
    body = {"vector": base64.b64encode(np.asarray(vector, dtype=np.float32).tobytes()).decode(), **vars(entry)}
    return RECORD_MAGIC + json.dumps(body).encode()


def read_record(data: bytes, dim: int) -> tuple[np.ndarray, IndexEntry]:
    """The ``(vector, entry)`` of a record blob; ValueError when it is not one or its vector is not ``dim`` long."""
    if not data.startswith(RECORD_MAGIC):
        raise ValueError("not a kvforge semantic index record")
    try:
        body = json.loads(data[len(RECORD_MAGIC) :])
        vector = np.frombuffer(base64.b64decode(body.pop("vector")), dtype=np.float32)
        entry = _entry(body)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"damaged semantic index record ({e})") from None
    if vector.shape != (dim,) or not np.isfinite(vector).all():
        raise ValueError(f"semantic index record holds a vector of {vector.size} values, expected {dim}")
    return vector, entry


def _entry(fields: Any) -> IndexEntry:
    """An entry read from a store: a key that is a valid store key, text and namespace that are strings (else
    ValueError, as a client's name would be refused)."""
    if not isinstance(fields, dict) or set(fields) - {"key", "text", "namespace"}:
        raise ValueError("an index entry is not {key, text, namespace}")
    entry = IndexEntry(**fields)
    if not isinstance(entry.key, str) or not _KEY_RE.match(entry.key):
        raise ValueError(f"index entry key {str(entry.key)[:40]!r} is not a store key")
    if not isinstance(entry.text, str) or not isinstance(entry.namespace, str):
        raise ValueError("index entry text or namespace is not a string")
    return entry
