"""The reuse seam: a strategy turns a prompt into a :class:`ReusePlan` (what is cached, what is left to prefill).

Strategies own a store (anything with the ``KVStore`` methods they use) and know nothing of the engine; the engine
runs ``plan -> prefill plan.prefill_ids on plan.cache -> record -> decode``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
from torch import Tensor

from kvforge.cache import KVCache
from kvforge.types import ChunkFacts, DocumentFacts, KVSegment, ReuseFacts

logger = logging.getLogger(__name__)

ReuseKind = Literal["miss", "prefix", "semantic", "chunks", "given"]


@dataclass(frozen=True)
class PromptContext:
    """The reusable document part of a prompt: its text and how many leading prompt tokens encode it.

    ``token_ids[:num_tokens]`` is the context (system + user header + document), the rest is the question, as
    returned by ``Engine.encode_qa``. With a ``press``, the document is compressed query-agnostic (before the question
    is seen) and stored compressed, quantised under ``quant`` (None: the store's own quantisation); a strategy that
    cannot store compressed documents refuses such a context.
    """

    text: str
    num_tokens: int
    press: Any = None
    quant: str | None = None

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"a prompt context needs at least one token, got num_tokens={self.num_tokens}")


@dataclass(frozen=True)
class ChatContext:
    """The conversation before the user's last message: ``token_ids[:num_tokens]`` (the system prompt, the chat
    template's header, earlier turns) and its text (earlier turns, ``role: content``). The user's words follow it.

    A semantic strategy embeds only what the user wrote (the template and a default system prompt, the same in every
    prompt, would make any two prompts look alike) and takes as candidates only prompts with exactly these leading
    tokens. Other strategies ignore it: it is no document.
    """

    text: str
    num_tokens: int

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"a chat context needs at least one token, got num_tokens={self.num_tokens}")


@dataclass
class Check:
    """An approximate lookup to label right or wrong after its answer (semantic reuse's verification).

    The engine runs two greedy requests of ``num_tokens`` new tokens through its loop, after the answer that asked
    for the check: ``asked_ids`` after a full prefill, and the donor's prompt on the stored KV the lookup found
    (``load()``: ``(a fresh cache of the donor prompt's first tokens, the donor prompt's ids)``, None when that KV
    is gone). Reuse was right when both continue with the same tokens (ending at the same step); ``report(agree)``
    gets the outcome.
    """

    asked_ids: list[int]
    load: Callable[[], tuple[KVCache, list[int]] | None]
    report: Callable[[bool], None]
    num_tokens: int = 8

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"a check continues at least one token, got num_tokens={self.num_tokens}")


@dataclass
class ReusePlan:
    """What reuse found for a prompt.

    Args:
        cache: the reused entries loaded into a cache ready to prefill on top (None on a miss).
        reused_tokens: tokens covered by ``cache`` (its ``next_position``).
        prefill_ids: tokens still to run through the model, on top of ``cache``; never empty (logits come from them).
        kind: "miss", "prefix" (exact token match), "semantic" (a similar, not identical, prompt was matched) or
            "chunks" (RAG chunks assembled at new positions: :class:`kvforge.reuse.rag.ChunkPlan`).
        approximate: True when the model will not see exactly the prompt that was asked (canonical semantic mode
            answers the donor prompt; context mode reuses a slightly different document).
        similarity: cosine similarity of the semantic match (None for exact reuse and misses).
        donor_prompt: the text of the matched stored prompt (semantic hits).
        reason: why it is a miss.
        document_key, document: the document looked up, and what was loaded (document reuse).
        chunks: what RAG chunk reuse did.
        info: other facts, reported only (number of blocks loaded, load time...).
        press_size: the first ``press_size`` tokens of ``prefill_ids`` are the document part a document strategy did
            not find: prefilled under the request's press (when it has one) as one step unit, and recorded alone.
        prefill_positions: the RoPE position of each of ``prefill_ids`` when they are not the ones following
            ``cache`` (RAG chunk plans recompute tokens in the middle of the prompt); None = consecutive.
        logits: the last prompt token's logits ``(1, V)`` when ``cache`` already covers the whole prompt.
        check: a lookup the engine verifies after the answer (:class:`Check`; semantic reuse samples some).

    ``prefill_ids`` is empty only when ``logits`` are given or the request generates nothing (storing a document).
    """

    cache: KVCache | None
    reused_tokens: int
    prefill_ids: list[int]
    kind: ReuseKind = "miss"
    approximate: bool = False
    similarity: float | None = None
    donor_prompt: str | None = None
    reason: str | None = None
    document_key: str | None = None
    document: DocumentFacts | None = None
    chunks: ChunkFacts | None = None
    info: dict[str, Any] = field(default_factory=dict)
    press_size: int = 0
    prefill_positions: list[int] | None = None
    logits: Tensor | None = None
    check: Check | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill_ids and self.cache is None:
            raise ValueError("a miss must leave at least one token to prefill (its logits start decoding)")
        if (self.cache is None) != (self.reused_tokens == 0):
            raise ValueError("reused_tokens must be > 0 exactly when a cache is given")

    @property
    def is_hit(self) -> bool:
        return self.kind != "miss"

    @property
    def token_ids(self) -> list[int]:
        """The prompt the model actually sees: reused tokens + prefilled ones (the donor's in canonical mode)."""
        reused = [] if self.cache is None else list(self.cache.token_ids[: self.reused_tokens])
        return reused + list(self.prefill_ids)

    def facts(self, **engine: Any) -> ReuseFacts:
        """What this plan reuses (``engine``: the facts only the engine knows, e.g. ``plan_s``)."""
        details = {k: v for k, v in self.info.items() if isinstance(v, (str, int, float, bool))}
        return ReuseFacts(self.kind, self.reused_tokens, self.approximate, self.similarity, self.donor_prompt,
                          self.reason, self.document_key, self.document, self.chunks, details, **engine)  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """The facts as one flat JSON object (result rows)."""
        return self.facts().as_dict()


@runtime_checkable
class ReuseStrategy(Protocol):
    """Finds reusable KV for a prompt and records the KV of prompts just computed.

    The engine executes any plan the same way: load ``plan.cache`` -> prefill ``plan.prefill_ids`` (the first
    ``plan.press_size`` under the press) -> decode -> ``record``. A strategy that stores compressed documents
    (``context.press`` set) says so by its type (:class:`StoresCompressedDocuments`); the engine refuses a press
    with any other strategy. ``record`` gets the cache holding exactly what the plan asked to compute and store: for a
    compressed document, the document's compressed KV alone (before the question was added).
    """

    def plan(
        self, token_ids: Sequence[int], *, text: str | None = None, context: PromptContext | None = None
    ) -> ReusePlan: ...

    def record(
        self, token_ids: Sequence[int], cache: KVCache, *, text: str | None = None, context: PromptContext | None = None
    ) -> None: ...


class StoresCompressedDocuments:
    """Base of the reuse strategies that store a prompt's document part whole, compressed by the request's
    query-agnostic press (``context.press``): the only strategies a press combines with
    (:func:`kvforge.errors.check_combination`)."""


@dataclass
class GivenCache:
    """A cache the caller computed, as a strategy: with ``logits`` (the last prompt token's) it holds the whole prompt,
    without them the prompt's first ``cache.next_position`` tokens. Plans it as it is; records nothing.

    The evaluation compresses one prefill with many presses and runs each as a request on its cache this way.
    """

    cache: KVCache
    logits: Tensor | None = None

    def plan(
        self, token_ids: Sequence[int], *, text: str | None = None, context: PromptContext | None = None
    ) -> ReusePlan:
        ids = list(token_ids)
        if self.logits is not None:  # the whole prompt is in the cache (at whatever positions it placed it)
            return ReusePlan(self.cache, len(ids), [], kind="given", logits=self.logits)
        n = self.cache.next_position
        if n >= len(ids) or (self.cache.token_ids and self.cache.token_ids[:n] != ids[:n]):
            raise ValueError("the given cache must hold a prefix of the prompt (or come with the last logits)")
        if n == 0:
            return miss_plan(ids)
        return ReusePlan(self.cache, n, ids[n:], kind="given")

    def record(
        self, token_ids: Sequence[int], cache: KVCache, *, text: str | None = None, context: PromptContext | None = None
    ) -> None:
        """Nothing is stored."""


@runtime_checkable
class Embedder(Protocol):
    """Text -> L2-normalised float32 vectors ``(N, dim)``."""

    @property
    def dim(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def miss_plan(
    token_ids: Sequence[int], reason: str | None = None, document_key: str | None = None, **info: Any
) -> ReusePlan:
    """The plan that reuses nothing: prefill everything."""
    if not token_ids:
        raise ValueError("empty prompt: nothing to prefill")
    return ReusePlan(None, 0, list(token_ids), reason=reason, document_key=document_key, info=dict(info))


def encode_ids(token_ids: Sequence[int]) -> bytes:
    """Canonical byte encoding of token ids: little-endian uint32 (independent of tensor dtype and process)."""
    arr = np.asarray(list(token_ids), dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def digest(*parts: bytes | str) -> str:
    """sha256 hex digest over length-prefixed parts (so part boundaries cannot be shifted into a collision)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def covers(segments: Sequence[KVSegment], end: int) -> bool:
    """True when the segments' entries below ``end`` are all that a query at position ``end`` can attend to.

    Full-attention layers need every position ``< end``; sliding-window layers (``meta["layer_windows"]``) only
    the last ``window - 1`` ones (they may have compacted older entries away).
    """
    windows = segments[0].meta.get("layer_windows") or [None] * segments[0].num_layers
    for i, window in enumerate(windows):
        lo = 0 if window is None else max(0, end - window + 1)
        held = sum(int(((s.positions[i][0] >= lo) & (s.positions[i][0] < end)).sum()) for s in segments)
        if held != end - lo:
            return False
    return True


def holds_exactly(cache: KVCache, ids: Sequence[int]) -> bool:
    """True when ``cache`` was computed from exactly ``ids`` (its first tokens), with no approximate reuse inside.

    Guards ``record``: the KV of a donor prompt must never be stored under another prompt's key.
    """
    ids = list(ids)
    if cache.token_ids and cache.token_ids[: len(ids)] != ids:
        logger.debug("cache tokens differ from the prompt (donor KV?): not recorded")
        return False
    if cache.next_position < len(ids):
        logger.debug("cache covers %d of %d prompt tokens: not recorded", cache.next_position, len(ids))
        return False
    if cache.reuse is not None and cache.reuse.approximate:
        logger.debug("cache was built on approximate (semantic) reuse: not recorded")
        return False
    return True


def full_layers_complete(segment: KVSegment, windows: Sequence[int | None], num_tokens: int) -> bool:
    """Every full-attention layer holds one entry per token (no compression dropped any)."""
    return all(k.shape[1] == num_tokens for k, w in zip(segment.keys, windows, strict=True) if w is None)
