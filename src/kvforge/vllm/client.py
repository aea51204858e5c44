"""Compressed documents for a vLLM server, from the client's side (no vLLM import): store a document compressed by
kvforge, and turn a question on it into the request vLLM serves from the stored KV.

>>> docs = VllmDocuments.for_model(model_folder, "file:///var/cache/kv", press="kvzip", compression_ratio=0.75)
>>> docs.add(["<a long report>"])                                   # compressed once, by kvforge's engine
>>> body = docs.completion("<a long report>", "Who wrote it?")      # None: not stored, send the chat as it is
>>> requests.post("http://127.0.0.1:8000/v1/completions", json={"model": model_folder, **body, "max_tokens": 64})

A question is matched to a document exactly as ``kvforge serve`` matches one: the prompt ``[system?, user]`` whose
user message is ``document + "\\n\\n" + question``, tokenised with the chat template, keyed by the model, the
document's tokens, the press with its parameters and the storage quantisation. Any difference is another key: a
miss, never a wrong hit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvforge.errors import UserError
from kvforge.vllm import documents as docs

if TYPE_CHECKING:
    from kvforge.engine import Engine
    from kvforge.presses.base import Press
    from kvforge.store.base import KVStore

logger = logging.getLogger(__name__)

DEFAULT_SLOT_MULTIPLE = 128  # vLLM's default block size on CPU (and a multiple of its GPU default, 16)


def whole_blocks_press(press: Press, num_tokens: int, multiple: int | None) -> Press:
    """``press`` for a document of ``num_tokens`` tokens, keeping its own count rounded down to a multiple of
    ``multiple`` (never more than the press asks; a count under one multiple stays as it is): the same press, another
    compression ratio."""
    from dataclasses import replace

    from kvforge.presses.base import num_kept

    ratio = getattr(press, "compression_ratio", None)
    if not multiple or ratio is None:
        return press
    kept = num_kept(num_tokens, ratio)
    target = kept - kept % multiple
    return press if target in (0, kept) else replace(press, compression_ratio=1.0 - target / num_tokens)


def uniform_press(name: str, compression_ratio: float) -> Press:
    """The press ``name`` keeping one count of entries on every layer and KV head (what vLLM's cache holds):
    ``budget="token"`` (the same tokens in every KV head of a layer) for presses with a budget unless the name sets
    ``head`` or ``tokens``; a press named with a ragged budget is refused. Presses that can keep words whole do
    (``whole_words=True`` unless the name says otherwise): with one count per head, a head otherwise keeps scattered
    pieces of a number (docs/vllm.md)."""
    from kvforge.names import parse_press
    from kvforge.presses import build_press
    from kvforge.presses.kvzip import UNIFORM_BUDGETS

    base, options = parse_press(name)
    press = build_press(name, compression_ratio)
    overrides: dict[str, Any] = {}
    if hasattr(press, "budget") and press.budget not in UNIFORM_BUDGETS:
        if "budget" in options:
            raise UserError(
                f"press {name!r}: vLLM's paged cache holds one count of entries for every layer and KV head; "
                f"use budget={' or budget='.join(UNIFORM_BUDGETS)}"
            )
        overrides["budget"] = "token"
    if hasattr(press, "whole_words") and "whole_words" not in options:
        overrides["whole_words"] = True
    if overrides:
        press = build_press(name, compression_ratio, **overrides)
    if type(press).__name__ in ("AdaKVPress", "CriticalAdaKVPress", "PyramidKVPress", "DecodingPress"):
        raise UserError(f"press {base!r} keeps a different number of entries per layer or head: vLLM cannot hold it")
    return press


@dataclass
class DocumentMatch:
    """A question on a stored compressed document, as vLLM serves it."""

    doc: docs.ServedDocument
    prompt_ids: list[int]  # the placeholder, then the question's tokens

    def completion(self) -> dict[str, Any]:
        """The fields of a ``/v1/completions`` body that ask for it (add model, max_tokens, sampling)."""
        return {"prompt": self.prompt_ids, "kv_transfer_params": self.doc.params()}


@dataclass
class VllmDocuments:
    """Stores documents compressed for vLLM and builds the requests that use them.

    Args:
        store: the kvforge store the vLLM server's connector reads.
        tokenizer: the served model's tokenizer (its chat template makes the prompt).
        model_id: the served model's kvforge fingerprint (:func:`kvforge.model.folder_fingerprint`).
        press: a press keeping a uniform count (:func:`uniform_press`); None stores documents uncompressed.
        quant: storage quantisation or transform code (``int8``, ``kvtc``, ...; None: the store's own).
        engine: kvforge's engine on the same weights, to compress documents (only :meth:`store` needs it).
        slot_multiple: a document keeps what the press keeps rounded down to a multiple of this many slots (vLLM's
            block size, or a multiple of it: 128 is vLLM's CPU default and a multiple of its GPU default 16), so
            its placeholder fills whole blocks and a later question on a document vLLM still holds is a plain
            prefix-cache hit: vLLM caches only whole blocks, and a partial last block is loaded again each time.
            None or 0: the press's own count.
    """

    store: KVStore
    tokenizer: Any
    model_id: str
    press: Press | None
    quant: str | None = None
    engine: Engine | None = None
    slot_multiple: int | None = DEFAULT_SLOT_MULTIPLE
    _reuse: Any = field(default=None, repr=False)

    @classmethod
    def for_model(
        cls, folder: str | os.PathLike[str], store: str | KVStore, press: str | None = "kvzip",
        compression_ratio: float = 0.75, quant: str | None = None, load: bool = True, slot_multiple: int | None = None,
    ) -> VllmDocuments:  # fmt: skip
        """For the model folder vLLM serves (``load``: also load it into kvforge's engine, to store documents).
        ``slot_multiple`` None: the block size of vLLM's cache that a connector announced for ``folder`` in the
        store, else :data:`DEFAULT_SLOT_MULTIPLE`; 0: the press's own count."""
        from kvforge.model import folder_fingerprint
        from kvforge.store import open_store

        folder = os.fspath(folder)  # a Path is as good as its string (the fingerprint reads the string)
        press_obj = uniform_press(press, compression_ratio) if press else None
        if quant is not None:
            from kvforge.store.base import check_quant

            quant = check_quant(quant)
        kv = open_store(store) if isinstance(store, str) else store
        if load:
            from kvforge.engine import Engine
            from kvforge.model import load_model

            model, tokenizer = load_model(folder)
            engine: Engine | None = Engine(model, tokenizer)
            model_id = engine.model_id  # type: ignore[union-attr]
            from kvforge.kvzap_train import ensure_trained

            ensure_trained(press_obj, model, tokenizer)  # a learned press's scorer: trained once per model
        else:
            from transformers import AutoTokenizer

            engine, tokenizer, model_id = None, AutoTokenizer.from_pretrained(folder), folder_fingerprint(folder)
        if slot_multiple is None:
            from kvforge.vllm.identity import find_served

            served = find_served(kv, folder)
            slot_multiple = (served.kv_block_size if served else None) or DEFAULT_SLOT_MULTIPLE
        return cls(kv, tokenizer, model_id, press_obj, quant, engine, slot_multiple)

    @property
    def reuse(self) -> Any:
        from kvforge.reuse.document import DocumentReuse

        if self._reuse is None:
            self._reuse = DocumentReuse(self.store, self.model_id)
        return self._reuse

    @property
    def stored_quant(self) -> str:
        """The canonical name of the code documents are stored under (``none``: full precision)."""
        from kvforge.reuse.document import quant_name

        return quant_name(self.quant if self.quant is not None else getattr(self.store, "quant", None))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def _context(self, text: str, num_tokens: int) -> Any:
        from kvforge.reuse.base import PromptContext

        return PromptContext(text, num_tokens, press=self.press_for(num_tokens), quant=self.quant)

    def press_for(self, num_tokens: int) -> Press | None:
        """The press a document of ``num_tokens`` tokens is stored with (its count in whole blocks of slots)."""
        return None if self.press is None else whole_blocks_press(self.press, num_tokens, self.slot_multiple)

    def key(
        self, text: str, question: str = "?", system: str | None = None, answer_prefix: str = ""
    ) -> tuple[str, list[int]]:
        """(the document's store key, the question's tokens after it) for ``text`` asked ``question``."""
        key, _, q_ids = self._key(text, question, system, answer_prefix)
        return key, q_ids

    def _key(self, text: str, question: str, system: str | None, answer_prefix: str) -> tuple[str, int, list[int]]:
        from kvforge.request import encode_qa

        ctx_ids, q_ids = encode_qa(self.tokenizer, text, question, system, answer_prefix)
        return self.reuse.key(ctx_ids, self._context(text, len(ctx_ids))), len(ctx_ids), q_ids

    def add(self, texts: Sequence[str], system: str | None = None) -> list[docs.ServedDocument]:
        """Compress and store each document once (kvforge's engine), described for vLLM; stored ones are kept."""
        from kvforge.request import Document, Request

        if self.engine is None:
            raise UserError("storing documents needs kvforge's engine on the served weights (load=True)")
        out = []
        for text in texts:
            key, num_tokens, _ = self._key(text, "?", system, "")
            doc = docs.find(self.store, key)
            if doc is None:
                if not self.store.contains(key):
                    request = Request(Document(text, None, system), max_new_tokens=0, press=self.press_for(num_tokens),
                                      query_aware=False, reuse=self.reuse, quant=self.quant)  # fmt: skip
                    self.engine.run(request)
                doc = docs.publish(self.store, key, self.vocab_size)
            out.append(doc)
        return out

    def match(
        self, text: str, question: str, system: str | None = None, answer_prefix: str = ""
    ) -> DocumentMatch | None:
        """The vLLM request for ``question`` on stored ``text`` (None: not stored for this model, press and code)."""
        key, q_ids = self.key(text, question, system, answer_prefix)
        doc = docs.find(self.store, key)
        if doc is None and self.store.contains(key):  # stored by kvforge's own engine, not yet described
            try:
                doc = docs.publish(self.store, key, self.vocab_size)
            except docs.DocumentError as e:
                logger.info("stored document %s cannot be served by vLLM: %s", key[:24], e)
                return None
        if doc is None or not q_ids:
            return None
        return DocumentMatch(doc, docs.document_prompt(doc, q_ids))

    def completion(self, text: str, question: str, system: str | None = None) -> dict[str, Any] | None:
        """``/v1/completions`` fields for ``question`` on stored ``text`` (None: not stored: ask the full prompt)."""
        found = self.match(text, question, system)
        return None if found is None else found.completion()
