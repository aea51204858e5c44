"""Compressed documents served from vLLM's paged cache, without vLLM: what a stored document looks like to vLLM,
the prompt that asks for it, and the KV the connector writes into the request's slots.

A document compressed query-agnostic by kvforge (:class:`kvforge.reuse.document.DocumentReuse`) keeps ``k`` of its
``n`` entries. vLLM's paged cache holds the same number of slots for every layer and KV head, one block table per
request, and places token ``i`` of a prompt at position ``i``. So:

- **uniform selection.** A document served by vLLM keeps the same ``k`` on every layer and KV head (``budget="token"``
  for KVzip and KVzap: the same tokens in every KV head of a layer, or ``"head"``: a top-k per head; the plain
  per-head top-k of the other scorer presses). Which entries each layer or head keeps may differ: every slot holds a
  post-RoPE key, and attention never asks where it came from.
- **one constant rotation.** RoPE is relative. Rotating every kept key by ``k - n`` positions and placing the
  question right after the ``k`` slots gives every question token at vLLM's position ``k + j`` exactly the
  distances to the kept entries it has at kvforge's position ``n + j``; decoding goes on from there.
- **a placeholder prefix.** The request's prompt is ``k`` placeholder tokens, then the question's tokens. The
  placeholder is derived from the document's store key and a nonce written when the document was described for
  vLLM, so vLLM's own prefix cache never mixes two documents (nor two writes of one key), and the connector fills
  those ``k`` slots from the store (``kv_transfer_params: {"kvforge_document": ...}`` names the document).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from kvforge.errors import UserError

if TYPE_CHECKING:
    from kvforge.rope import RopeSpec
    from kvforge.store.base import KVStore
    from kvforge.types import KVSegment

logger = logging.getLogger(__name__)

PARAM = "kvforge_document"  # the key of ``kv_transfer_params`` that names a stored document
BLOB_PREFIX = "vllm-doc-"  # store blob describing a stored document for vLLM (slots, nonce)
_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
MAX_KEY_LENGTH = 128


class DocumentError(UserError):
    """A document that vLLM cannot serve from its stored KV (ragged, another model, malformed parameters)."""


@dataclass(frozen=True)
class ServedDocument:
    """A stored compressed document as vLLM serves it.

    Args:
        key: the document's store key (:meth:`kvforge.reuse.document.DocumentReuse.key`).
        num_tokens: ``n``, the document's tokens (the positions it covers in kvforge's engine).
        num_slots: ``k``, the entries kept on every layer and KV head (the slots it takes in vLLM's cache).
        nonce: random, written with the description: a re-stored document gets another placeholder.
        vocab_size: placeholder ids are drawn below it (the tokenizer's size: vLLM refuses ids past its vocabulary).
    """

    key: str
    num_tokens: int
    num_slots: int
    nonce: str
    vocab_size: int

    def __post_init__(self) -> None:
        if not (isinstance(self.key, str) and 0 < len(self.key) <= MAX_KEY_LENGTH and set(self.key) <= _KEY_CHARS):
            raise DocumentError(f"{PARAM}: 'key' must be a kvforge document key, got {str(self.key)[:40]!r}")
        for name in ("num_tokens", "num_slots", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DocumentError(f"{PARAM}: {name!r} must be a positive integer, got {value!r}")
        if self.num_slots > self.num_tokens:
            raise DocumentError(f"{PARAM}: {self.num_slots} slots for a document of {self.num_tokens} tokens")
        if not (isinstance(self.nonce, str) and 8 <= len(self.nonce) <= 64 and self.nonce.isalnum()):
            raise DocumentError(f"{PARAM}: 'nonce' must be 8-64 letters or digits")

    @property
    def shift(self) -> int:
        """Positions every kept key moves by: ``k - n`` (the question starts at ``k`` in vLLM, ``n`` in kvforge)."""
        return self.num_slots - self.num_tokens

    def placeholder_ids(self) -> list[int]:
        """The ``k`` token ids standing for the document in vLLM's prompt (deterministic, unique per key and nonce)."""
        seed = hashlib.sha256(f"kvforge-vllm-placeholder-v1\0{self.key}\0{self.nonce}".encode()).digest()
        rng = np.random.default_rng(np.frombuffer(seed, dtype=np.uint32))
        return rng.integers(0, self.vocab_size, size=self.num_slots).tolist()

    def params(self) -> dict[str, Any]:
        """``kv_transfer_params`` of a request served from this document."""
        return {PARAM: asdict(self)}

    @classmethod
    def from_params(cls, params: Any) -> ServedDocument | None:
        """The document a request's ``kv_transfer_params`` names (None: it names none); malformed is an error."""
        if not isinstance(params, dict) or PARAM not in params:
            return None
        fields = params[PARAM]
        if not isinstance(fields, dict) or set(fields) != {"key", "num_tokens", "num_slots", "nonce", "vocab_size"}:
            raise DocumentError(f"{PARAM} must be an object with key, num_tokens, num_slots, nonce and vocab_size")
        return cls(**fields)


def blob_key(document_key: str) -> str:
    return BLOB_PREFIX + document_key


def uniform_slots(segment: KVSegment) -> int | None:
    """``k`` when every layer and KV head of ``segment`` holds ``k`` entries (no padding), else None."""
    sizes = {int(k.shape[1]) for k in segment.keys}
    if len(sizes) != 1 or any(m is not None and not bool(m.all()) for m in segment.valid):
        return None
    return sizes.pop()


def describe(segment: KVSegment, key: str, vocab_size: int) -> ServedDocument:
    """A new description of stored ``segment`` (a fresh nonce); refuses what vLLM's cache cannot hold."""
    slots = uniform_slots(segment)
    if slots is None:
        counts = sorted({int(k.shape[1]) for k in segment.keys})
        raise DocumentError(
            f"document {key[:24]} keeps a different number of entries per layer or KV head ({counts[0]}..{counts[-1]}"
            f"{', head-wise padding' if any(m is not None for m in segment.valid) else ''}); vLLM's paged cache "
            'holds one count for every layer and head: compress it with a uniform budget (budget="token" or "head" '
            "for kvzip and kvzap, or a plain scorer press such as knorm, snapkv, streaming_llm)"
        )
    return ServedDocument(key, segment.next_position, slots, secrets.token_hex(8), vocab_size)


def find(store: KVStore, key: str) -> ServedDocument | None:
    """The description of stored document ``key`` when the document is stored and described, else None."""
    data = store.get_blob(blob_key(key))
    if data is None or len(data) > 4096:
        return None
    try:
        doc = ServedDocument(**json.loads(data))
    except (ValueError, TypeError, UserError):
        return None
    return doc if doc.key == key and store.contains(key) else None


def publish(store: KVStore, key: str, vocab_size: int, segment: KVSegment | None = None) -> ServedDocument:
    """The description of stored document ``key``, written now if missing (read from ``segment`` or the store)."""
    doc = find(store, key)
    if doc is not None:
        return doc
    segment = segment if segment is not None else store.get(key)
    if segment is None:
        raise DocumentError(f"document {key[:24]} is not stored")
    doc = describe(segment, key, vocab_size)
    store.put_blob(blob_key(key), json.dumps(asdict(doc), sort_keys=True).encode())
    return doc


def withdraw(store: KVStore, key: str) -> None:
    """Forget the description of ``key`` (a load failed: its placeholder must never be sent again)."""
    try:
        store.delete_blob(blob_key(key))
    except Exception as e:  # a store that went away: the document's next load fails again, and is a miss
        logger.debug("description of %s not removed (%s)", key[:24], e)


def check_document(segment: KVSegment, doc: ServedDocument, model_id: str, num_layers: int, num_kv_heads: int,
                   head_size: int) -> str | None:  # fmt: skip
    """Why ``segment`` cannot fill ``doc``'s slots in a vLLM cache of this shape (None = it can)."""
    if segment.model_id != model_id:
        return f"made by model {segment.model_id!r}, not {model_id!r}"
    if segment.next_position != doc.num_tokens or len(segment.token_ids) != doc.num_tokens:
        return f"covers {segment.next_position} tokens, the request names {doc.num_tokens}"
    if uniform_slots(segment) != doc.num_slots:
        return f"does not keep {doc.num_slots} entries on every layer and KV head"
    if segment.num_layers != num_layers:
        return f"has {segment.num_layers} layers, the model {num_layers}"
    shape = (num_kv_heads, doc.num_slots, head_size)
    if any(
        tuple(k.shape) != shape or tuple(v.shape) != shape for k, v in zip(segment.keys, segment.values, strict=True)
    ):
        return f"holds KV of shape {tuple(segment.keys[0].shape)}, expected {shape}"
    return None


def slot_kv(
    segment: KVSegment, doc: ServedDocument, rope: RopeSpec, dtype: torch.dtype
) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer ``(H_kv, k, D)`` keys and values for the ``k`` slots: each head's kept entries in position order,
    keys rotated by ``k - n`` positions (computed in fp32, cast to the cache's ``dtype``)."""
    keys, values = [], []
    for layer, (k, v, p) in enumerate(zip(segment.keys, segment.values, segment.positions, strict=True)):
        if p.shape[-1] > 1 and not bool((p[:, 1:] > p[:, :-1]).all()):  # kept entries in position order (the order
            order = p.argsort(dim=-1)  # kvforge's engine holds), (H_kv, k)
            k = k.gather(1, order[..., None].expand_as(k))
            v = v.gather(1, order[..., None].expand_as(v))
        keys.append(rope.rotate(k.float(), doc.shift, layer).to(dtype))
        values.append(v.to(dtype))
    return keys, values


def document_prompt(doc: ServedDocument, question_ids: Sequence[int]) -> list[int]:
    """vLLM's prompt for a question on ``doc``: the placeholder, then the question's tokens (template included)."""
    if not question_ids:
        raise DocumentError("a question on a stored document needs at least one token after the document")
    return doc.placeholder_ids() + [int(t) for t in question_ids]
