"""Verification outcomes of semantic lookups, shared by every process that uses one store, with no lost update.

An observation is one verified lookup: the top-1 candidate's similarity bin, whether reusing it was wrong, and which
guards refused it (a set of names, so the statistics serve any guard configuration). Each process writes ONE blob,
its own (``<prefix><writer id>``), and never another's, so two processes, several servers or a restart never
overwrite each other's counts: the store is a grow-only counter per writer (a G-counter CRDT). Reading merges every
writer's blob; a blob may also carry copies of other writers' counts (after compaction), and a writer's counts are
taken from whichever copy has seen the most observations (counts only grow). Compaction folds the blobs of writers
silent for ``stale_s`` into the caller's own blob and deletes them, so the number of blobs stays near the number of
live processes. Per-entry observations (what raises one entry's threshold) are kept for entries still indexed only,
at most ``max_per_entry`` each, so the statistics stay a few KB per entry and go when the entry's KV goes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

FORMAT = "kvforge-semantic-stats-1"
CountKey = tuple[int, str, int]  # (wrong 0/1, refusing guards joined by "+", similarity bin or NEVER)


def guard_key(failed: Iterable[str]) -> str:
    return "+".join(sorted(failed))


@dataclass
class Observation:
    """One verified lookup of an entry: its similarity, whether reuse was wrong, the guards that refused it."""

    similarity: float
    wrong: bool
    failed: str = ""  # guard_key of the refusing guards
    obs_id: str = ""


@dataclass
class StatsView:
    """Merged statistics: counts of (wrong, refusing guards, bin) and each entry's recent observations."""

    counts: Counter[CountKey] = field(default_factory=Counter)
    entries: dict[str, list[Observation]] = field(default_factory=dict)

    @property
    def num_observations(self) -> int:
        return sum(self.counts.values())


def _encode_counts(counts: Counter[CountKey]) -> list[list[Any]]:
    return [[w, g, b, c] for (w, g, b), c in sorted(counts.items()) if c]


def _decode_counts(rows: Any) -> Counter[CountKey]:
    out: Counter[CountKey] = Counter()
    for w, g, b, c in rows:
        out[(int(w), str(g), int(b))] += int(c)
    return out


class SharedStats:
    """The statistics of one (model, mode, embedder) namespace in ``store``; see the module docstring.

    Args:
        store: anything with ``put_blob``/``get_blob``/``delete_blob``/``blob_keys``.
        prefix: blob key prefix of this namespace (letters, digits, ``._-``).
        refresh_s: merged statistics are re-read at most this often (0: before every use).
        stale_s: a writer silent this long is folded into the next writer that saves.
        max_per_entry: recent observations kept per entry.
    """

    def __init__(
        self, store: Any, prefix: str, refresh_s: float = 5.0, stale_s: float = 86400.0, max_per_entry: int = 32
    ) -> None:
        self.store, self.prefix = store, prefix
        self.refresh_s, self.stale_s, self.max_per_entry = refresh_s, stale_s, max_per_entry
        self.writer = uuid.uuid4().hex[:16]
        self.lock = threading.RLock()
        self._own: dict[str, dict[str, Any]] = {}  # writer id -> {"n": int, "counts": Counter} (own + absorbed)
        self._own_entries: dict[str, list[Observation]] = {}
        self._seq = 0
        self._view: StatsView | None = None
        self._read_at = float("-inf")

    # ------------------------------------------------------------------------------------------ write
    def observe(self, entry_key: str, similarity: float, wrong: bool, failed: Iterable[str], bin_: int) -> None:
        """Add one verified lookup and save this writer's blob (one small put; nobody else writes it)."""
        with self.lock:
            mine = self._own.setdefault(self.writer, {"n": 0, "counts": Counter()})
            mine["n"] += 1
            mine["counts"][(int(wrong), guard_key(failed), bin_)] += 1
            self._seq += 1
            obs = Observation(round(similarity, 4), wrong, guard_key(failed), f"{self.writer}:{self._seq}")
            kept = self._own_entries.setdefault(entry_key, [])
            kept.append(obs)
            del kept[: -self.max_per_entry]
            self._save()
            self._view = None  # re-merge on next read

    def prune(self, alive: set[str]) -> None:
        """Forget the per-entry observations of entries no longer indexed (their KV was evicted)."""
        with self.lock:
            gone = [k for k in self._own_entries if k not in alive]
            for key in gone:
                del self._own_entries[key]
            if gone:
                self._save()

    def _blob_key(self, writer: str) -> str:
        return f"{self.prefix}{writer}"

    def _save(self) -> None:
        body = {
            "format": FORMAT,
            "writer": self.writer,
            "updated": time.time(),
            "writers": {w: {"n": v["n"], "counts": _encode_counts(v["counts"])} for w, v in self._own.items()},
            "entries": {k: [[o.similarity, int(o.wrong), o.failed, o.obs_id] for o in obs]
                        for k, obs in self._own_entries.items()},
        }  # fmt: skip
        try:
            self.store.put_blob(self._blob_key(self.writer), json.dumps(body, separators=(",", ":")).encode())
        except OSError as e:  # a full or read-only store: the counts stay in memory and are saved with the next one
            logger.warning("semantic statistics not saved (%s): kept in memory", e)

    # ------------------------------------------------------------------------------------------ read
    def view(self, force: bool = False) -> StatsView:
        """Every writer's statistics merged (cached for ``refresh_s``)."""
        with self.lock:
            if not force and self._view is not None and time.monotonic() - self._read_at < self.refresh_s:
                return self._view
            self._view = self._merge(self._read_all())
            self._read_at = time.monotonic()
            return self._view

    def _read_all(self) -> list[dict[str, Any]]:
        keys = [k for k in self.store.blob_keys() if k.startswith(self.prefix)]
        blobs = []
        for key in keys:
            if key == self._blob_key(self.writer):
                continue  # our own counts are in memory, and newer
            data = self.store.get_blob(key)
            if data is None:
                continue
            try:
                body = json.loads(data)
                if not isinstance(body, dict) or body.get("format") != FORMAT:
                    raise ValueError("not a statistics blob of this format")
                _check_body(body)
                body["_key"] = key
                blobs.append(body)
            except (ValueError, TypeError, AttributeError, KeyError) as e:
                logger.warning("semantic statistics blob %s skipped: %s", key, e)
        return blobs

    def _merge(self, blobs: list[dict[str, Any]]) -> StatsView:
        best: dict[str, tuple[int, Counter[CountKey]]] = {w: (v["n"], v["counts"]) for w, v in self._own.items()}
        entries: dict[str, dict[str, Observation]] = {}
        for key, obs in self._own_entries.items():
            entries[key] = {o.obs_id: o for o in obs}
        for body in blobs:
            for w, v in body.get("writers", {}).items():
                n = int(v.get("n", 0))
                if w not in best or n > best[w][0]:
                    best[w] = (n, _decode_counts(v.get("counts", [])))
            for key, rows in body.get("entries", {}).items():
                held = entries.setdefault(key, {})
                for sim, wrong, failed, obs_id in rows:
                    held.setdefault(obs_id, Observation(float(sim), bool(wrong), str(failed), str(obs_id)))
        total: Counter[CountKey] = Counter()
        for _, counts in best.values():
            total.update(counts)
        return StatsView(total, {k: list(v.values()) for k, v in entries.items()})

    def compact(self) -> int:
        """Fold the blobs of writers silent for ``stale_s`` into this writer's blob and delete them; returns how many.

        Safe with concurrent compactors and readers: counts are merged per writer id by their maximum, so a blob
        folded twice, or read while being folded, is never counted twice.
        """
        with self.lock:
            now, folded = time.time(), []
            for body in self._read_all():
                if now - float(body.get("updated", now)) < self.stale_s:
                    continue
                for w, v in body.get("writers", {}).items():
                    n = int(v.get("n", 0))
                    if w not in self._own or n > self._own[w]["n"]:
                        self._own[w] = {"n": n, "counts": _decode_counts(v.get("counts", []))}
                for key, rows in body.get("entries", {}).items():
                    held = {o.obs_id for o in self._own_entries.get(key, [])}
                    obs = self._own_entries.setdefault(key, [])
                    obs += [Observation(float(s), bool(w), str(g), str(i)) for s, w, g, i in rows if i not in held]
                    del obs[: -self.max_per_entry]
                folded.append(body["_key"])
            if folded:
                self._save()  # the copies first, then the originals go: a crash in between double-stores, never loses
                for key in folded:
                    self.store.delete_blob(key)
                self._view = None
            return len(folded)


def _check_body(body: dict[str, Any]) -> None:
    """Raise unless a statistics blob read from a store has the shape :meth:`SemanticStats._merge` and ``compact``
    read (writers' counts, entries' observations, a time): another writer's blob is input, not trusted."""
    float(body.get("updated", 0.0))
    writers, entries = body.get("writers", {}), body.get("entries", {})
    if not isinstance(writers, dict) or not isinstance(entries, dict):
        raise TypeError("writers and entries are not objects")
    for v in writers.values():
        int(v.get("n", 0))
        _decode_counts(v.get("counts", []))
    for rows in entries.values():
        for sim, wrong, failed, obs_id in rows:
            float(sim), bool(wrong), str(failed), str(obs_id)
