"""Semantic prompt reuse: a similar stored prompt's KV, served only where its error rate is bounded.

After C. Lee (Samsung Electronics), "A Study on the Caching Strategies for Semantically Similar Prompts in KV Cache
Storage Offloading" (embedding -> FAISS top-1 -> cosine >= 0.7 -> the matched prompt's tokens and KV). kvforge
decides hit or miss with one decision function (:mod:`kvforge.reuse.decide`): the top-1 candidate's score (its
cosine similarity, or with ``verifier="default"`` a learned verifier's, :mod:`kvforge.reuse.verifier`) must reach a
threshold certified for a bounded false-hit rate (after vCache: the user sets ``max_error``;
:mod:`kvforge.reuse.policy`), raised per entry by verified lookups shared through the store
(:mod:`kvforge.reuse.stats`), and the word guards (:mod:`kvforge.reuse.guards`) must pass. Only what the user wrote
is compared (the request's text: a chat's last user message, :func:`kvforge.request.encode_turn`).

Modes:
    ``canonical`` (the paper): the prompt text is embedded, the top-1 stored prompt is the candidate, and on a hit
        the model is run on the candidate's tokens with its KV (only its last token is recomputed). The answer is to
        the stored prompt: the plan is flagged approximate with the similarity. With a :class:`PromptContext` (a
        document) or a :class:`ChatContext` (a chat's system prompt, template header and earlier turns) only prompts
        with byte-identical context tokens are candidates.
    ``context`` (ours): only the long document part is reused, exactly (same context tokens) or from a donor
        document that differs only slightly (the policy, the guards, and a word-level edit ratio >=
        ``min_text_ratio``). The user's question is always prefilled exactly.

Verification: a share ``verify_ratio`` of the lookups whose best candidate has similarity >= 0.5 (hits and misses
alike, so the sample is a uniform one) carry a :class:`~kvforge.reuse.base.Check` in their plan: after the answer,
the engine continues the prompt asked (full prefill) and the candidate's prompt (on its stored KV) greedily through
its loop, and whether both agree is added, with the candidate's score, to the shared statistics: every process
sharing the store learns from it.

The donor's KV is never stored under the new prompt's key (``record`` refuses a cache that does not hold exactly the
prompt's tokens, or that was built on approximate reuse). The index lives in the store as one small record blob per
entry (:mod:`kvforge.reuse.index`): concurrent writers and restarts merge, and before each search the records other
processes added since are loaded. The stored segments are the ground truth: each carries its text and namespace in
its header, so an entry whose record is missing or damaged is indexed again from its segment
(:meth:`SemanticReuse.reconcile`). Records (and statistics) of entries whose KV the store evicted are deleted after
every write, so what the semantic index keeps follows the store's byte budget.
"""

from __future__ import annotations

import difflib
import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from kvforge.cache import KVCache
from kvforge.errors import StoreUnavailableError
from kvforge.reuse.base import (
    ChatContext,
    Check,
    PromptContext,
    ReusePlan,
    covers,
    digest,
    encode_ids,
    full_layers_complete,
    holds_exactly,
    miss_plan,
)
from kvforge.reuse.bound import to_bin
from kvforge.reuse.decide import Decider, Decision, build_decider
from kvforge.reuse.guards import tokens
from kvforge.reuse.index import IndexEntry, SemanticIndex, read_record, record_bytes
from kvforge.reuse.policy import POPULATION_FLOOR, BoundedErrorPolicy, Policy
from kvforge.reuse.stats import SharedStats, StatsView
from kvforge.types import KVSegment, ReuseFacts

if TYPE_CHECKING:
    from kvforge.reuse.base import Embedder
    from kvforge.store.base import KVStore

logger = logging.getLogger(__name__)

KEY_PREFIX = "semantic-v1-"
MODES = ("canonical", "context")


def text_ratio(a: str, b: str) -> float:
    """Word-level similarity ratio in [0, 1] (difflib): 1.0 = same words in the same order."""
    return difflib.SequenceMatcher(a=tokens(a), b=tokens(b), autojunk=False).ratio()


@dataclass
class SemanticReuse:
    """Reuse the KV of the nearest stored prompt (or document) by embedding.

    Args:
        store: a ``KVStore`` (get/put/contains/delete, put_blob/get_blob).
        model_id: model + tokenizer fingerprint; part of every key.
        embedder: an :class:`Embedder` (``MiniLMEmbedder`` in production, ``FakeEmbedder`` in tests).
        mode: "canonical" or "context" (see the module docstring).
        threshold: a fixed minimum cosine similarity (the paper's rule) instead of the bounded error rate.
        max_error: the tolerated false-hit rate (default 0.01 when ``threshold`` is not given); see
            :mod:`kvforge.reuse.policy`.
        policy: a ready policy object instead of ``threshold``/``max_error``.
        guards: names from :data:`kvforge.reuse.guards.GUARDS`; any difference they find is a miss (default: those
            of :data:`~kvforge.reuse.decide.VERIFIER_GUARDS` with the verifier, every guard without).
        verifier: None (the default): the cosine similarity is the score; ``"default"``: the learned verifier shipped
            for the embedder scores canonical-mode candidates (:mod:`kvforge.reuse.verifier`, opt-in); or a
            verifier object.
        min_text_ratio: context mode: minimum word-level edit ratio between the documents.
        device: where loaded entries go.
        reconcile_s: before a search, index stored segments that have no index record if the last such check is
            older than this (it also runs on open, after each write and when a damaged record is met).
        verify_ratio: the share of lookups verified (0: none; the statistics then grow from other processes only).
        check_tokens: how many greedy tokens a verified lookup must agree on.
        stats_refresh_s: the shared statistics are re-read at most this often.
        seed: seed of the verification sampling.
    """

    store: KVStore
    model_id: str
    embedder: Embedder
    mode: Literal["canonical", "context"] = "canonical"
    threshold: float | None = None
    max_error: float | None = None
    policy: Policy | None = None
    guards: Sequence[str] | None = None
    verifier: Any = None
    min_text_ratio: float = 0.9
    device: Any = None
    reconcile_s: float = 60.0
    verify_ratio: float = 0.05
    check_tokens: int = 8
    stats_refresh_s: float = 5.0
    seed: int | None = None
    index: SemanticIndex = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown semantic mode {self.mode!r}; choose from {list(MODES)}")
        verifier = self.verifier if self.mode == "canonical" else None  # documents: the cosine and every guard
        decider = build_decider(self.embedder, threshold=self.threshold, max_error=self.max_error, guards=self.guards,
                                verifier=verifier, policy=self.policy)  # fmt: skip
        self.policy, self.guards, self.verifier = decider.policy, decider.guards, decider.verifier
        if not 0.0 <= self.verify_ratio <= 1.0:
            raise ValueError(f"verify_ratio is a share in [0, 1], got {self.verify_ratio}")
        if not self.model_id:
            raise ValueError("model_id must name the model and tokenizer")
        self.namespace = digest("kvforge-semantic-v1", self.model_id)
        self.index_key = f"{KEY_PREFIX}index-{digest(self.namespace, self.mode)}"  # the former single-blob index
        self.record_prefix = f"{KEY_PREFIX}rec-{digest(self.namespace, self.mode)[:24]}-"
        self._records: dict[str, int | None] = {}  # record blob key -> index id (None: unreadable, skipped)
        self._unindexable: set[str] = set()  # stored keys of this mode that are not ours (another model, no text)
        self._reconciled_at = float("-inf")
        embedder_name = str(getattr(self.embedder, "name", type(self.embedder).__name__))
        scorer = () if self.decider.verifier is None else (self.decider.scorer,)  # cosine statistics keep their name
        stats_ns = digest(self.namespace, self.mode, embedder_name, *scorer)[:24]
        self.stats = SharedStats(self.store, f"{KEY_PREFIX}stats-{stats_ns}-", refresh_s=self.stats_refresh_s)
        self._lock = threading.Lock()  # the sampling generator (plans run on the model thread and in tests' threads)
        self._rng = random.Random(self.seed)
        self.index = self._open_index()

    # ------------------------------------------------------------------------------------------------ keys
    def entry_key(self, token_ids: Sequence[int]) -> str:
        """Store key of the KV of exactly ``token_ids`` (a whole prompt, or a context part)."""
        return f"{KEY_PREFIX}{self.mode}-{digest(self.namespace, encode_ids(token_ids))}"

    def _split(self, ids: list[int], context: PromptContext | ChatContext | None) -> tuple[list[int], str]:
        """(tokens whose KV is stored/reused, namespace the candidates must share) for this mode."""
        if self.mode == "context" and isinstance(context, PromptContext):
            if context.num_tokens > len(ids):
                raise ValueError(f"context has {context.num_tokens} tokens, the prompt only {len(ids)}")
            return ids[: context.num_tokens], ""
        namespace = "" if context is None else digest(encode_ids(ids[: context.num_tokens]))
        return ids, namespace

    # ------------------------------------------------------------------------------------------------ plan
    def plan(
        self, token_ids: Sequence[int], *, text: str | None = None, context: PromptContext | ChatContext | None = None
    ) -> ReusePlan:
        ids = list(token_ids)  # an empty prompt is refused by miss_plan
        t0 = time.perf_counter()
        reused_ids, namespace = self._split(ids, context)
        tail = ids[len(reused_ids) :]  # context mode: the question, always prefilled; canonical: nothing
        exact = self._load(self.entry_key(reused_ids), reused_ids)
        if exact is not None:
            return self._plan(exact, ids, tail, t0, kind="prefix")
        is_document = isinstance(context, PromptContext)
        query = context.text if (self.mode == "context" and is_document) else text  # type: ignore[union-attr]
        if not query or (self.mode == "context" and not is_document):
            return miss_plan(ids, reason="no text to match")
        found, check = self._find(query, namespace, ids, tail)
        if isinstance(found, str):
            plan = miss_plan(ids, reason=found)
            plan.check = check
            return plan
        similarity, entry, segment, score = found
        assert segment is not None
        plan = self._plan(segment, ids, tail, t0, kind="semantic")
        plan.check = check
        if plan.cache is not None:
            plan.approximate, plan.similarity, plan.donor_prompt = True, similarity, entry.text
            plan.info["score"] = score
            plan.cache.reuse = plan.facts()
        return plan

    def _plan(self, segment: KVSegment, ids: list[int], tail: list[int], t0: float, kind: str) -> ReusePlan:
        """Cache from ``segment`` then ``tail`` to prefill (or, with no tail, the segment's last token again)."""
        reused_ids = segment.token_ids
        end = len(reused_ids) if tail else len(reused_ids) - 1
        prefill_ids = tail if tail else reused_ids[-1:]
        if end == 0 or not covers([segment], end):
            return miss_plan(ids, reason="stored KV does not cover the reused part")
        cache = KVCache.from_segments(
            [segment], end=end, layer_windows=segment.meta.get("layer_windows"), device=self.device
        )
        cache.reuse = ReuseFacts(kind, end)
        return ReusePlan(
            cache=cache,
            reused_tokens=end,
            prefill_ids=prefill_ids,
            kind=kind,  # type: ignore[arg-type]
            info={"load_s": time.perf_counter() - t0, "mode": self.mode},
        )

    @property
    def decider(self) -> Decider:
        """The decision function of this strategy (its current policy, guards and verifier)."""
        assert self.policy is not None and self.guards is not None
        return Decider(self.policy, tuple(self.guards), self.verifier)

    def _stats(self) -> StatsView | None:
        return self.stats.view() if isinstance(self.policy, BoundedErrorPolicy) else None

    def threshold_for(self, entry_key: str) -> float:
        """The score a candidate ``entry_key`` needs now (the policy's, from the shared statistics)."""
        return self.decider.policy.threshold_for(entry_key, self.decider.guards, self._stats())

    def decide(self, query: str, donor: str, similarity: float, entry_key: str = "") -> Decision:
        """The decision on one candidate with this strategy's decider and the shared statistics as they are now
        (what every lookup, the router's included, decides with)."""
        return self.decider.decide(query, donor, similarity, entry_key, self._stats())

    def lookup(self, query: str, namespace: str = "") -> tuple[float, IndexEntry] | str:
        """The stored entry ``query`` would reuse under this strategy's policy (threshold, guards), without loading
        its KV: ``(similarity, entry)``, or why there is none (no verification is sampled). For callers whose KV is
        loaded by another engine (the router in front of vLLM); entries whose KV the store no longer holds are
        dropped on the way."""
        found = self._find(query, namespace, [], [], sample=False, load=False)[0]
        return found if isinstance(found, str) else (found[0], found[1])

    def index_text(self, key: str, text: str, namespace: str = "") -> None:
        """Index ``text`` for KV that another writer stored under ``key`` (a vLLM server's connector); candidates
        of a search must share ``namespace``."""
        if text and not self.index.has(key, text):
            self._add(self.embedder.embed([text])[0], IndexEntry(key=key, text=text, namespace=namespace))

    def _find(
        self, query: str, namespace: str, ids: list[int], tail: list[int], sample: bool = True, load: bool = True
    ) -> tuple[tuple[float, IndexEntry, KVSegment | None, float] | str, Check | None]:
        """(the top-1 stored entry in ``namespace`` if the policy serves it, with its KV when ``load``, or why not;
        the check of this lookup when it was sampled for verification)."""
        vector = self.embedder.embed([query])[0]
        self.refresh()  # entries other processes recorded since
        stale = []
        try:
            for similarity, vid in self._candidates(vector, namespace):
                entry = self.index.entries[vid]
                decision = self.decide(query, entry.text, similarity, entry.key)
                reason = decision.reason
                if reason is None and self.mode == "context" and text_ratio(query, entry.text) < self.min_text_ratio:
                    reason = f"documents differ by more than {1 - self.min_text_ratio:.0%} of their words"
                segment = None
                if reason is None:
                    if not load:
                        if not self.store.contains(entry.key):
                            stale.append(vid)
                            continue
                        return (similarity, entry, None, decision.score), None
                    segment = self.store.get(entry.key)
                    if segment is None:
                        stale.append(vid)  # evicted: drop it from the index and look further
                        continue
                    if segment.model_id != self.model_id:
                        return "stored KV made by another model", None
                check = self._sample(ids, entry.key, similarity, decision, tail) if sample else None
                if segment is None:
                    return str(reason), check  # top-1 only: a worse candidate is never tried after a refused one
                return (similarity, entry, segment, decision.score), check
            return "no similar prompt stored", None
        finally:
            if stale:
                self._drop(stale)

    # ------------------------------------------------------------------------------------------------ verify
    def _sample(self, ids: list[int], key: str, similarity: float, decision: Decision, tail: list[int]) -> Check | None:
        """With probability ``verify_ratio``, a :class:`Check` of this lookup (hit or miss: a uniform sample of the
        lookups whose candidate is in the bound's population) that the engine runs after the answer."""
        if similarity < POPULATION_FLOOR or not self.verify_ratio:
            return None
        with self._lock:
            if self._rng.random() >= self.verify_ratio:
                return None

        def load() -> tuple[KVCache, list[int]] | None:
            segment = self.store.get(key)
            if segment is None or segment.model_id != self.model_id:
                return None
            donor_ids = list(segment.token_ids)
            end = len(donor_ids) if tail else len(donor_ids) - 1
            if end == 0 or not covers([segment], end):
                return None
            windows = segment.meta.get("layer_windows")
            cache = KVCache.from_segments([segment], end=end, layer_windows=windows, device=self.device)
            return cache, donor_ids + list(tail)

        score, refused = decision.score, decision.refused

        def report(agree: bool) -> None:
            self.stats.observe(key, score, not agree, refused, to_bin(score))
            logger.info("semantic lookup verified: %s at score %.3f", "right" if agree else "wrong", score)

        return Check(list(ids), load, report, num_tokens=self.check_tokens)

    def _candidates(self, vector: np.ndarray, namespace: str) -> list[tuple[float, int]]:
        """Search results in ``namespace``, best first (widening the search until one is found or all are seen)."""
        k = 16
        while True:
            found = self.index.search(vector, k=k)
            inside = [(s, i) for s, i in found if self.index.entries[i].namespace == namespace]
            if inside or k >= len(self.index):
                return inside
            k *= 8

    def _load(self, key: str, ids: list[int]) -> KVSegment | None:
        if not self.store.contains(key):
            return None
        segment = self.store.get(key)
        if segment is None or segment.token_ids != ids or segment.model_id != self.model_id:
            return None
        return segment

    # ------------------------------------------------------------------------------------------------ record
    def record(
        self,
        token_ids: Sequence[int],
        cache: KVCache,
        *,
        text: str | None = None,
        context: PromptContext | ChatContext | None = None,
    ) -> None:
        """Store the KV of the prompt (canonical) or of its document (context mode) and index its text."""
        ids = list(token_ids)
        is_document = isinstance(context, PromptContext)
        if not ids or (self.mode == "context" and not is_document):
            return
        stored_ids, namespace = self._split(ids, context)
        if not holds_exactly(cache, stored_ids):
            return
        key = self.entry_key(stored_ids)
        query = context.text if self.mode == "context" and is_document else text  # type: ignore[union-attr]
        if not self.store.contains(key):
            try:
                segment = cache.to_segment(self.model_id, stored_ids, start=0, end=len(stored_ids))
            except ValueError as e:
                logger.debug("not recording: %s", e)
                return
            windows = list(cache.native_windows)
            if not full_layers_complete(segment, windows, len(stored_ids)):
                logger.debug("cache lacks entries of the prompt (compressed?): not recorded")
                return
            segment.meta = {
                "layer_windows": windows,
                "text": query or "",
                "namespace": namespace,  # with the text: what rebuilds the index entry if its record is lost
                "format": KEY_PREFIX + self.mode,
            }
            self.store.put(key, segment)
            self.sync(listed=True)  # the put may have evicted entries: their records go too (the byte budget)
        if query and not self.index.has(key, query):  # a repeated prompt changes nothing: no index write
            self._add(self.embedder.embed([query])[0], IndexEntry(key=key, text=query, namespace=namespace))
            self.reconcile()  # segments another writer stored without their record (killed between the two)

    # ------------------------------------------------------------------------------------------------ index
    def _record_key(self, entry: IndexEntry) -> str:
        return self.record_prefix + digest(entry.key, entry.text, entry.namespace)[:32]

    def _add(self, vector: np.ndarray, entry: IndexEntry, write: bool = True) -> None:
        """Index ``entry``; with ``write`` its record blob is stored (one small put, never a rewrite of others)."""
        record_key = self._record_key(entry)
        if write:
            self.store.put_blob(record_key, record_bytes(vector, entry))
        for old_key, vid in list(self._records.items()):  # an entry with the same key is replaced (index.add)
            if vid is not None and vid in self.index.entries and self.index.entries[vid].key == entry.key:
                self._records.pop(old_key)
        self._records[record_key] = self.index.add(vector, entry)

    def _drop(self, ids: list[int]) -> None:
        """Remove index ids whose KV is gone, and their record blobs."""
        gone = set(ids)
        for record_key, vid in list(self._records.items()):
            if vid in gone:
                self._records.pop(record_key)
                delete = getattr(self.store, "delete_blob", None)
                if delete is not None:
                    delete(record_key)
        self.index.remove(ids)

    def _record_keys(self) -> list[str] | None:
        list_blobs = getattr(self.store, "blob_keys", None)
        if list_blobs is None:
            return None
        return [k for k in list_blobs() if k.startswith(self.record_prefix)]

    def refresh(self) -> int:
        """Load the index records written since the last look (by any process); returns how many were added.

        A damaged record is skipped with a warning and its entry is indexed again from its stored segment.
        """
        added, damaged = self._load_records()
        if damaged or time.monotonic() - self._reconciled_at > self.reconcile_s:
            added += self.reconcile()
        return added

    def _load_records(self) -> tuple[int, bool]:
        """Load the records not seen yet: (how many were added, whether a listed record was unreadable)."""
        keys = self._record_keys()
        if keys is None:
            return 0, False
        added = 0
        damaged = False
        for record_key in keys:
            if record_key in self._records:
                continue
            blob = self.store.get_blob(record_key)
            if blob is None:  # listed but unreadable: the store found it corrupt (and removed it), or it just went
                damaged = True
                continue
            try:
                vector, entry = read_record(blob, self.embedder.dim)
            except ValueError as e:
                logger.warning("semantic index record %s skipped: %s (its entry is indexed again from its KV)",
                               record_key, e)  # fmt: skip
                self._records[record_key] = None
                damaged = True
                continue
            self._add(vector, entry, write=False)
            added += 1
        return added, damaged

    def reconcile(self) -> int:
        """Index the stored segments of this model and mode that have no index entry, from their own header (text,
        namespace) and write their records again; returns how many were indexed.

        What makes the index and the segments agree again after a writer was killed between its segment and its
        record, or after a record was damaged or deleted. Segments of other models are recognised from their
        summary (no payload read) and remembered; only segments of this model without an entry are read.
        """
        if getattr(self.store, "keys", None) is None:
            return 0
        try:
            found = self._unindexed()
        except StoreUnavailableError as e:  # a store that is down: nothing to reconcile with now, try again later
            logger.debug("semantic index not reconciled: %s", e)
            return 0
        self._reconciled_at = time.monotonic()
        if found:
            vectors = self.embedder.embed([e.text for e in found])
            for vector, entry in zip(vectors, found, strict=True):
                self._add(vector, entry)
            logger.info("semantic index: %d stored entr%s indexed again from their KV", len(found),
                        "y" if len(found) == 1 else "ies")  # fmt: skip
        return len(found)

    def _unindexed(self) -> list[IndexEntry]:
        """Index entries of the stored segments of this model and mode that the index lacks."""
        self._load_records()  # entries other writers indexed meanwhile are not missing
        prefix = f"{KEY_PREFIX}{self.mode}-"
        indexed = {e.key for e in self.index.entries.values()}
        describe = getattr(self.store, "describe", None)
        found: list[IndexEntry] = []
        stored = self.store.keys()
        for key in stored:
            if not key.startswith(prefix) or key in indexed or key in self._unindexable:
                continue
            summary = describe(key) if describe is not None else {"model_id": self.model_id}
            if summary is None:
                continue  # gone meanwhile, or an unreadable header (a miss when met)
            entry = None
            if summary.get("model_id") == self.model_id:
                segment = self.store.get(key)
                if segment is None:
                    continue
                entry = self._entry_from(key, segment)
            if entry is None:
                self._unindexable.add(key)
            else:
                found.append(entry)
        return found

    def _entry_from(self, key: str, segment: KVSegment) -> IndexEntry | None:
        """The index entry a stored segment stands for, or None when it is not one of ours (or cannot say)."""
        meta = segment.meta
        text, namespace = meta.get("text"), meta.get("namespace")
        if namespace is None and self.mode == "context":
            namespace = ""  # context mode has one namespace
        if (
            segment.model_id != self.model_id
            or meta.get("format") != KEY_PREFIX + self.mode
            or not isinstance(text, str)
            or not text
            or not isinstance(namespace, str)  # canonical segments of an older kvforge: the context is unknown
            or key != self.entry_key(segment.token_ids)
        ):
            return None
        return IndexEntry(key=key, text=text, namespace=namespace)

    def _open_index(self) -> SemanticIndex:
        self.index = SemanticIndex(self.embedder.dim)
        self._migrate_single_blob()
        self.refresh()
        self.sync()
        return self.index

    def _migrate_single_blob(self) -> None:
        """Read an index saved by an older kvforge as one blob, and write its entries as records (kept as is)."""
        blob = self.store.get_blob(self.index_key)
        if blob is None:
            return
        try:
            old = SemanticIndex.from_bytes(blob)
        except (ValueError, KeyError) as e:
            logger.warning("unreadable single-blob semantic index (%s): ignored", e)
            return
        if old.dim != self.embedder.dim:
            logger.warning("stored semantic index has dim %d, embedder %d: ignored", old.dim, self.embedder.dim)
            return
        for vid, entry in old.entries.items():
            if self._record_key(entry) not in self._records:
                self._add(old.index.reconstruct(int(vid)), entry)

    def sync(self, listed: bool = True) -> int:
        """Drop index entries (and their record blobs and statistics) whose KV is no longer stored; returns how many.

        With ``listed`` the store's keys are listed once (one call however many entries); else each is asked."""
        if listed and getattr(self.store, "keys", None) is not None:
            try:
                held = set(self.store.keys())
            except StoreUnavailableError as e:
                logger.debug("semantic index not synced: %s", e)
                return 0
            stale = [vid for vid, e in self.index.entries.items() if e.key not in held]
        else:
            stale = [vid for vid, e in self.index.entries.items() if not self.store.contains(e.key)]
        if stale:
            self._drop(stale)
            self.stats.prune({e.key for e in self.index.entries.values()})
        return len(stale)
