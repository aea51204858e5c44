"""Document reuse: the document part of a prompt, compressed query-agnostic under a press (or not), stored whole.

A document is stored once as ONE segment holding its compressed KV (ragged per layer, head-wise masks and the RoPE
position of every kept entry preserved). Its key names the model, the document's token ids, the press with all its
parameters (``Press.config()``) and the storage quantisation, and the same facts are written in the segment's meta:
another press, ratio or quantisation is another key (a miss), and a segment whose meta disagrees with what was asked
is refused (never a wrong hit). A later question loads the document and prefills only itself, at its exact positions
(the cache's ``next_position`` is the document's token count, whatever was dropped).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvforge.cache import KVCache
from kvforge.reuse.base import PromptContext, ReusePlan, StoresCompressedDocuments, digest, encode_ids, miss_plan
from kvforge.store.quant import canonical_quant
from kvforge.types import DocumentFacts, ReuseFacts

if TYPE_CHECKING:
    from kvforge.store.base import KVStore

logger = logging.getLogger(__name__)

KEY_PREFIX = "doc-v1-"


def press_spec(press: Any) -> dict[str, Any]:
    """The press as plain JSON values (type and every hyperparameter): part of the key and of the stored meta."""
    if press is None:
        return {"type": "none"}
    spec = press.config() if hasattr(press, "config") else {"type": type(press).__name__, **vars(press)}
    return json.loads(json.dumps(spec, sort_keys=True, default=str))


def quant_name(quant: str | None) -> str:
    """Canonical name of a storage quantisation (``"none"`` for full precision): ``int8`` -> ``int8-kivi``."""
    return canonical_quant(quant) or "none"


@dataclass
class DocumentReuse(StoresCompressedDocuments):
    """Finds and records documents in ``store``, compressed by the request's press when it has one (query-agnostic).

    A prompt without a document part (no :class:`~kvforge.reuse.base.PromptContext`) is a miss and records nothing.

    Args:
        store: a ``KVStore``; its ``put`` takes ``quant=`` to store a document under another quantisation.
        model_id: model + tokenizer fingerprint; part of every key.
        device: where loaded entries go (the model's device); None = as stored.
    """

    store: KVStore
    model_id: str
    device: Any = None

    def quant_of(self, context: PromptContext) -> str:
        """The quantisation this document is stored under: the context's, else the store's own."""
        return quant_name(context.quant if context.quant is not None else getattr(self.store, "quant", None))

    def key(self, doc_ids: Sequence[int], context: PromptContext) -> str:
        """Store key: model, document tokens, press spec and quantisation (any difference is another key)."""
        spec = json.dumps(press_spec(context.press), sort_keys=True)
        return KEY_PREFIX + digest("kvforge-doc-v1", self.model_id, encode_ids(doc_ids), spec, self.quant_of(context))

    def meta(self, context: PromptContext) -> dict[str, Any]:
        return {"format": KEY_PREFIX, "press": press_spec(context.press), "quant": self.quant_of(context)}

    def plan(
        self, token_ids: Sequence[int], *, text: str | None = None, context: PromptContext | None = None
    ) -> ReusePlan:
        """Load the document ``token_ids[:context.num_tokens]``; on a miss, compress it (``press_size``).

        A prompt that is the document alone (storing it) plans nothing to prefill when it is stored already.
        """
        ids = list(token_ids)
        if not isinstance(context, PromptContext):  # a plain prompt (a chat's context is no document)
            return miss_plan(ids, reason="no document in the prompt")
        num_doc = context.num_tokens
        if not 0 < num_doc <= len(ids):
            raise ValueError(f"a document of {num_doc} tokens does not fit a prompt of {len(ids)}")
        t0 = time.perf_counter()
        key = self.key(ids[:num_doc], context)
        segment = self.store.get(key)
        if segment is not None and not self._fits(segment, ids[:num_doc], context):
            logger.warning("stored document %s does not hold what its key names; treated as a miss", key)
            segment = None
        if segment is None:
            plan = miss_plan(ids, reason="document not stored", document_key=key)
            plan.press_size = num_doc if context.press is not None else 0
            return plan
        windows = segment.meta.get("layer_windows")
        cache = KVCache.from_segment(segment.to(self.device), layer_windows=windows)
        cache.info, cache.reuse = {}, ReuseFacts("prefix", num_doc)
        press = context.press
        loaded = DocumentFacts(
            compressed=press is not None,
            press=None if press is None else getattr(press, "name", str(press)),
            compression_ratio=float(press.ratio()) if hasattr(press, "ratio") else None,
            quant=self.quant_of(context),
            kept_entries=segment.num_entries(),
            bytes_loaded=_stored_bytes(self.store, key, segment),
            load_s=time.perf_counter() - t0,
        )
        return ReusePlan(cache, num_doc, ids[num_doc:], kind="prefix", document_key=key, document=loaded)

    def _fits(self, segment: Any, doc_ids: list[int], context: PromptContext) -> bool:
        meta = segment.meta or {}
        return (
            segment.model_id == self.model_id
            and list(segment.token_ids) == doc_ids
            and segment.next_position == len(doc_ids)
            and meta.get("press") == press_spec(context.press)
            and meta.get("quant") == self.quant_of(context)
        )

    def record(
        self, token_ids: Sequence[int], cache: KVCache, *, text: str | None = None, context: PromptContext | None = None
    ) -> None:
        """Store the document held by ``cache`` (exactly the document's tokens, nothing after them)."""
        if not isinstance(context, PromptContext):
            return
        doc_ids = list(token_ids[: context.num_tokens])
        if cache.next_position != len(doc_ids) or list(cache.token_ids) != doc_ids:
            logger.debug("cache does not hold exactly the document: not recorded")
            return
        key = self.key(doc_ids, context)
        if self.store.contains(key):
            return
        segment = cache.to_segment(self.model_id, doc_ids)
        segment.meta = {**self.meta(context), "layer_windows": list(cache.native_windows)}
        quant = self.quant_of(context)
        try:
            self.store.put(key, segment, quant=quant)
        except TypeError:  # a store without per-entry quantisation: only its own one can be honoured
            if quant != quant_name(getattr(self.store, "quant", None)):
                raise
            self.store.put(key, segment)
        logger.debug("stored document %s (%d tokens, %d entries)", key, len(doc_ids), cache.num_entries())


def _stored_bytes(store: Any, key: str, segment: Any) -> int:
    """Bytes the document takes in the store (its encoded size), or its tensors' bytes if the store cannot say."""
    size = getattr(store, "stored_size", None)
    try:
        stored = size(key) if size is not None else None
    except Exception:  # a store that cannot say: fall back to the tensors
        stored = None
    return int(stored) if stored else int(segment.nbytes())
