""" "Store once, ask many" trials: each document compressed (query-agnostic) and stored once, every question answered
from the store by a fresh engine.

A stored trial is a press at a ratio with a storage codec (``none``, ``int8``, ``int4``, ``kvtc-b2``, ...). The first
time a run meets a document (the context part of an example's prompt) it prefills it once for every press and ratio
(:class:`kvforge.presses.CompressionSource`: one prefill, one KVzip replay, as the press rows share them), compresses
it under each press and stores it under each codec through :class:`kvforge.reuse.DocumentReuse` (keyed by press,
parameters and codec); every question on that document, the first one included, is then
answered by a new :class:`kvforge.engine.Engine` whose plan loads the document from the store and prefills only the
question. TTFT is this warm path (store read, decoding of the codec, question prefill, first token). A document that
is in the store already (``--store file:///dir`` written by an earlier run, another process) is loaded as it is,
never compressed again (``stored_by_run`` False). Columns: ``stored_bytes`` (encoded size in the store),
``fp16_bytes`` (the document's full cache at 16 bits), ``stored_fraction`` (their ratio), ``load_s`` (store read and
decode), ``store_s`` (the one-off prefill + compression + encode-and-write).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvforge.engine import Engine
from kvforge.eval.data import Example
from kvforge.eval.runner import FULL, Prefilled, Trial, document_of, prefill_request
from kvforge.kvzap_train import ensure_trained
from kvforge.request import Request
from kvforge.reuse.base import PromptContext
from kvforge.reuse.document import DocumentReuse

QUANTS = ("none", "int8", "int4")


def stored_method(method: str, quant: str) -> str:
    """The row's method name: ``stored-<press>+<quant>`` (rows are keyed by method and ratio)."""
    return f"stored-{method}+{quant}"


@dataclass
class DocumentBank:
    """The store of a run and the document being stored: one :class:`CompressionSource` per document for every press
    and ratio of the run, the stored sizes and one-off costs per store key."""

    store: Any
    presses: list[Any] = field(default_factory=list)
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)
    _doc: tuple[int, ...] | None = None
    _source: Any = None

    def source(self, engine: Engine, ctx_ids: list[int]) -> Any:
        """The document prefilled once (full cache + what every press of the run scores from)."""
        from kvforge.presses import CompressionSource
        from kvforge.presses.layer import Needs

        if self._doc != tuple(ctx_ids) or self._source is None:
            needs = Needs()
            for press in self.presses:
                needs = needs.merge(press.needs())
            self._source = None  # free the previous document first
            self._source = CompressionSource(engine.model, ctx_ids, engine.new_cache(), needs,
                                             chunk_size=engine.chunk_size, tokenizer=engine.tokenizer)  # fmt: skip
            self._doc = tuple(ctx_ids)
        return self._source

    def ensure(self, engine: Engine, ctx_ids: list[int], context: PromptContext) -> dict[str, Any]:
        """Store the document under ``context`` (press, codec) unless the store has it; its columns."""
        writer = DocumentReuse(self.store, engine.model_id, device=engine.model.device)
        key = writer.key(ctx_ids, context)
        if key in self.stored:
            return self.stored[key]
        info: dict[str, Any] = {"stored_by_run": False, "store_s": None}
        if not self.store.contains(key):  # store once: compress the document alone (query-agnostic), record it
            start = time.perf_counter()
            source = self.source(engine, ctx_ids)
            cache = source.compress(context.press)
            seconds = cache.info["press"]["seconds"]
            shared = seconds.get("prefill", 0.0) + seconds.get("reconstruction", 0.0) + seconds.get("lookahead", 0.0)
            writer.record(ctx_ids, cache, context=context)
            info = {"stored_by_run": True, "store_s": shared + time.perf_counter() - start}
        info["stored_bytes"] = int(self.store.stored_size(key) or 0)
        info["fp16_bytes"] = self.fp16_bytes(engine, ctx_ids)
        info["stored_fraction"] = info["stored_bytes"] / info["fp16_bytes"] if info["fp16_bytes"] else None
        self.stored[key] = info
        return info

    def fp16_bytes(self, engine: Engine, ctx_ids: list[int]) -> int:
        """Bytes of the document's full cache at 16 bits per element (every entry a model of this shape holds)."""
        from kvforge.cache import KVCache

        config = engine.model.config.get_text_config() if hasattr(engine.model.config, "get_text_config") else (
            engine.model.config)  # fmt: skip
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        windows = KVCache.for_model(engine.model).native_windows
        n = len(ctx_ids)
        return sum(min(n, w) if w else n for w in windows) * kv_heads * head_dim * 2 * 2


def stored_trial(
    method: str, compression_ratio: float, quant: str, store_url: str = "memory://", bank: DocumentBank | None = None
) -> Trial:
    """A trial answering from a document stored once under ``method`` at ``compression_ratio``, coded ``quant``."""
    from kvforge.presses import build_press
    from kvforge.store import open_store
    from kvforge.store.quant import parse_scheme

    parse_scheme(quant)  # a bad name fails before any model work
    ratio = 0.0 if method == FULL else compression_ratio
    press = build_press(method, compression_ratio=ratio)  # "full": the no-op press, so the same stored path runs
    bank = bank if bank is not None else DocumentBank(open_store(store_url))
    bank.presses.append(press)

    def prefill(engine: Engine, example: Example) -> Prefilled:
        request = Request(document_of(example), 0, press=press, query_aware=False, quant=quant)
        encoded = engine.encode(request)
        context = encoded.context
        assert isinstance(context, PromptContext), "a stored trial needs a question after the document"
        ensure_trained(press, engine.model, engine.tokenizer)  # a learned press's scorer: trained once per model
        columns = bank.ensure(engine, encoded.ids[: context.num_tokens], context)
        reader = Engine(engine.model, engine.tokenizer, chunk_size=engine.chunk_size)  # ask many: a fresh engine
        request.reuse = DocumentReuse(bank.store, reader.model_id, device=engine.model.device)
        pre, seq = prefill_request(reader, request, example.max_new_tokens)
        if not seq.plan.is_hit:  # the store evicted it (too small), or cannot read it (its codec's basis is missing)
            raise RuntimeError(f"stored document {seq.plan.document_key} was not found again")
        assert seq.plan.document is not None
        pre.columns = {"quant": quant, **columns, "load_s": seq.plan.document.load_s}
        return pre

    return Trial(stored_method(method, quant), ratio, prefill)


def stored_trials(
    methods: Sequence[str], ratios: Sequence[float], quants: Sequence[str] = QUANTS, store_url: str = "memory://"
) -> list[Trial]:
    """Stored trials for every method x ratio x codec (``full`` once per codec), ratio by ratio, sharing one store and
    one prefill (and replay) per document."""
    from kvforge.store import open_store

    bank = DocumentBank(open_store(store_url))
    trials = [stored_trial(FULL, 0.0, q, store_url, bank) for q in quants if FULL in methods]
    trials += [stored_trial(m, r, q, store_url, bank) for r in ratios for m in methods if m != FULL for q in quants]
    return trials
