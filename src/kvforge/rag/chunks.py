"""RAG prompts split into a shared prefix, document chunks, separators and a question; chunk KV precomputed once.

Every chunk is prefilled after the ONE shared prefix (chat-template header / system prompt) and only the chunk's
entries are kept (positions ``P .. P+L-1``, P = prefix length), stored under a key made of the model fingerprint,
the prefix ids and the chunk ids. Chunks are tokenised separately, without special tokens, so a chunk has the
same ids wherever it lands; the ids are stored with the KV and checked on a hit.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvforge.cache import KVCache
from kvforge.prefill import prefill
from kvforge.types import KVSegment

logger = logging.getLogger(__name__)

KEY_VERSION = b"kvforge-rag-v1"
_PLACEHOLDER = "\x00KVFORGE_CONTEXT\x00"


class SegmentStore(Protocol):
    """The part of :class:`kvforge.store.KVStore` chunk reuse needs (hex key -> KVSegment)."""

    def get(self, key: str) -> KVSegment | None: ...
    def put(self, key: str, segment: KVSegment) -> None: ...


class DictStore:
    """In-process store: a dict of segments (used when no store URL is given)."""

    def __init__(self) -> None:
        self.segments: dict[str, KVSegment] = {}

    def get(self, key: str) -> KVSegment | None:
        return self.segments.get(key)

    def put(self, key: str, segment: KVSegment) -> None:
        self.segments[key] = segment


@dataclass
class RagPrompt:
    """A RAG prompt as token pieces: ``prefix + c_1 + sep + c_2 + sep + ... + c_n + sep + question``.

    ``chunk_offsets[i][j]`` is the character span of token j inside ``chunk_texts[i]`` (maps auxiliary tokens).
    The question piece also holds the end of the user turn and the assistant header.
    """

    prefix_ids: list[int]
    chunk_ids: list[list[int]]
    sep_ids: list[int]
    question_ids: list[int]
    chunk_texts: list[str] = field(default_factory=list)
    chunk_offsets: list[list[tuple[int, int]]] = field(default_factory=list)
    question: str = ""
    system: str | None = None
    separator: str = "\n\n"

    def ids(self) -> list[int]:
        """The whole prompt's token ids (what a full prefill sees)."""
        out = list(self.prefix_ids)
        for chunk in self.chunk_ids:
            out += chunk + self.sep_ids
        return out + self.question_ids

    @property
    def num_context_tokens(self) -> int:
        return sum(len(c) for c in self.chunk_ids)


def _template_halves(tokenizer: Any, system: str | None) -> tuple[str, str]:
    """Text before and after the user message content in the chat template (ends with the assistant header)."""
    if not getattr(tokenizer, "chat_template", None):
        return (tokenizer.bos_token or "") if getattr(tokenizer, "bos_token", None) else "", ""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _PLACEHOLDER}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, _, tail = text.partition(_PLACEHOLDER)
    return head, tail


def build_prompt(
    tokenizer: Any, docs: list[str], question: str, system: str | None = None, separator: str = "\n\n",
    answer_prefix: str = "",
) -> RagPrompt:
    """Tokenise a RAG prompt piece by piece (chat template around ``docs`` joined by ``separator`` + question).

    ``answer_prefix`` starts the assistant's answer (after the assistant header).
    """
    if not docs:
        raise ValueError("a RAG prompt needs at least one document")
    head, tail = _template_halves(tokenizer, system)
    enc = [tokenizer(d, add_special_tokens=False, return_offsets_mapping=True) for d in docs]
    for i, e in enumerate(enc):
        if not e["input_ids"]:
            raise ValueError(f"document {i} is empty after tokenisation")
    prompt = RagPrompt(
        prefix_ids=tokenizer(head, add_special_tokens=False)["input_ids"] if head else [],
        chunk_ids=[list(e["input_ids"]) for e in enc],
        sep_ids=tokenizer(separator, add_special_tokens=False)["input_ids"] if separator else [],
        question_ids=tokenizer(question + tail + answer_prefix, add_special_tokens=False)["input_ids"],
        chunk_texts=list(docs),
        chunk_offsets=[[tuple(o) for o in e["offset_mapping"]] for e in enc],
        question=question,
        system=system,
        separator=separator,
    )
    if not prompt.question_ids:
        raise ValueError("the question is empty after tokenisation")
    return prompt


def _ids_bytes(ids: list[int]) -> bytes:
    return struct.pack(f"<I{len(ids)}I", len(ids), *ids)


def chunk_key(model_id: str, prefix_ids: list[int], chunk_ids: list[int] | None) -> str:
    """Hex sha256 of (model fingerprint, prefix ids, chunk ids); ``chunk_ids=None`` keys the prefix itself."""
    h = hashlib.sha256(KEY_VERSION)
    h.update(_ids_bytes(list(model_id.encode())))
    h.update(_ids_bytes(prefix_ids))
    h.update(b"prefix" if chunk_ids is None else b"chunk" + _ids_bytes(chunk_ids))
    return h.hexdigest()


def fallback_model_id(model: Any, tokenizer: Any = None) -> str:
    """A fingerprint of architecture, config, a weight sample and vocabulary (used when kvforge.model is absent)."""
    h = hashlib.sha256(type(model).__name__.encode())
    h.update(model.config.to_json_string(use_diff=False).encode())
    emb = model.get_input_embeddings().weight
    h.update(emb.detach().flatten()[:256].float().cpu().numpy().tobytes())
    h.update(str(emb.dtype).encode())
    if tokenizer is not None:
        h.update(str(len(tokenizer)).encode() + str(getattr(tokenizer, "name_or_path", "")).encode())
    return h.hexdigest()[:32]


def model_id_of(model: Any, tokenizer: Any = None) -> str:
    """``kvforge.model.model_fingerprint`` when available, else :func:`fallback_model_id`."""
    try:
        from kvforge.model import model_fingerprint
    except ImportError:
        return fallback_model_id(model, tokenizer)
    return str(model_fingerprint(model, tokenizer))


def _text(prompt: RagPrompt, i: int) -> str | None:
    return prompt.chunk_texts[i] if i < len(prompt.chunk_texts) else None


class ChunkCache:
    """Prefix and chunk KV segments of one model, computed on a miss and kept in ``store``."""

    def __init__(self, model: Any, model_id: str, store: SegmentStore | None = None) -> None:
        self.model = model
        self.model_id = model_id
        self.store: SegmentStore = store if store is not None else DictStore()
        self.num_hits = 0
        self.num_misses = 0

    def _lookup(self, key: str, token_ids: list[int]) -> KVSegment | None:
        seg = self.store.get(key)
        if seg is None:
            return None
        if seg.token_ids != token_ids or (seg.model_id and seg.model_id != self.model_id):
            logger.warning("stored segment %s does not hold the expected tokens/model: recomputing it", key[:12])
            return None
        return seg

    def prefix(self, prefix_ids: list[int]) -> KVSegment | None:
        """KV of the shared prefix at positions ``0..P-1`` (None for an empty prefix)."""
        if not prefix_ids:
            return None
        key = chunk_key(self.model_id, prefix_ids, None)
        seg = self._lookup(key, prefix_ids)
        if seg is None:
            cache = KVCache.for_model(self.model)
            prefill(self.model, prefix_ids, cache, chunk_size=None)
            seg = cache.to_segment(self.model_id, prefix_ids)
            seg.meta = {"kind": "rag_prefix"}
            self.store.put(key, seg)
        return seg

    def chunk(self, prefix_ids: list[int], chunk_ids: list[int], text: str | None = None) -> KVSegment:
        """KV of ``chunk_ids`` prefilled after the prefix: only the chunk's entries, positions ``P..P+L-1``.

        ``text`` (the chunk's text) is kept in the stored segment's meta, so a request may name the chunk by its key.
        """
        key = chunk_key(self.model_id, prefix_ids, chunk_ids)
        seg = self._lookup(key, chunk_ids)
        if seg is not None:
            self.num_hits += 1
            return seg
        self.num_misses += 1
        seg = self.compute_chunk(prefix_ids, chunk_ids)
        if text is not None:
            seg.meta["text"] = text
        self.store.put(key, seg)
        return seg

    def text_of(self, key: str) -> str:
        """The text of the stored chunk ``key`` (KeyError when no chunk with its text is stored there)."""
        seg = self.store.get(key)
        text = None if seg is None else seg.meta.get("text")
        if not isinstance(text, str) or (seg is not None and seg.model_id and seg.model_id != self.model_id):
            raise KeyError(key)
        return text

    def compute_chunk(self, prefix_ids: list[int], chunk_ids: list[int]) -> KVSegment:
        prefix = self.prefix(prefix_ids)
        cache = KVCache.from_segment(prefix, self.model) if prefix is not None else KVCache.for_model(self.model)
        prefill(self.model, chunk_ids, cache, chunk_size=None)  # one forward: sliding layers keep every entry
        p, n = len(prefix_ids), len(chunk_ids)
        keys, values, positions = [], [], []
        for layer in cache.layers:
            k, v, pos, _ = layer.view()
            keep = pos[0, 0] >= p  # (S,) chunk entries (every head holds the same positions here)
            if int(keep.sum()) != n:
                raise RuntimeError(f"layer holds {int(keep.sum())} entries of a {n}-token chunk")
            keys.append(k[0][:, keep].clone())
            values.append(v[0][:, keep].clone())
            positions.append(pos[0][:, keep].clone())
        return KVSegment(
            token_ids=list(chunk_ids),
            keys=keys,
            values=values,
            positions=positions,
            valid=[None] * len(keys),
            next_position=p + n,
            model_id=self.model_id,
            meta={"kind": "rag_chunk", "prefix_len": p},
        )

    def warm(self, prompt: RagPrompt) -> None:
        """Make sure the prefix and every chunk of ``prompt`` are stored (precompute; not part of TTFT)."""
        with torch.inference_mode():
            self.prefix(prompt.prefix_ids)
            for i, chunk in enumerate(prompt.chunk_ids):
                self.chunk(prompt.prefix_ids, chunk, _text(prompt, i))
