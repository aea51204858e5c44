""" "Store once, ask many" trials: each document compressed (query-agnostic) and stored once, every question answered
from the store by a fresh engine.

A stored trial is a press at a ratio with a storage quantisation. The first time it meets a document (the context
part of an example's prompt) it compresses it under the press and stores it through
:class:`kvforge.reuse.DocumentReuse` (keyed by press, parameters and quantisation); every question on that document,
the first one included, is then answered by a new :class:`kvforge.engine.Engine` whose plan loads the document from
the store and prefills only the question. TTFT is this warm path (store read, dequantisation, question prefill, first
token); the one-off cost of compressing and storing is the ``store_s`` column, the encoded size ``stored_bytes``.
Rows carry the same columns as press rows, so both sit in one ``summary.json``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvforge.engine import Engine
from kvforge.eval.data import Example
from kvforge.eval.runner import FULL, Prefilled, Trial, document_of, prefill_request
from kvforge.request import Encoded, Request
from kvforge.reuse.base import PromptContext
from kvforge.reuse.document import DocumentReuse

QUANTS = ("none", "int8", "int4")


def stored_method(method: str, quant: str) -> str:
    """The row's method name: ``stored-<press>+<quant>`` (rows are keyed by method and ratio)."""
    return f"stored-{method}+{quant}"


def stored_trial(method: str, compression_ratio: float, quant: str, store_url: str = "memory://") -> Trial:
    """A trial answering from a document stored once under ``method`` at ``compression_ratio``, quantised ``quant``."""
    from kvforge.presses import build_press
    from kvforge.store import open_store
    from kvforge.store.quant import parse_scheme

    parse_scheme(quant)  # a bad name fails before any model work
    ratio = 0.0 if method == FULL else compression_ratio
    press = build_press(method, compression_ratio=ratio)  # "full": the no-op press, so the same stored path runs
    store = open_store(store_url)
    stored: dict[str, tuple[int, float]] = {}  # document key -> (stored bytes, seconds to compress and store)

    def prefill(engine: Engine, example: Example) -> Prefilled:
        request = Request(document_of(example), 0, press=press, query_aware=False, quant=quant)
        encoded = engine.encode(request)
        context = encoded.context
        assert isinstance(context, PromptContext), "a stored trial needs a question after the document"
        writer = DocumentReuse(store, engine.model_id, device=engine.model.device)
        key = writer.key(encoded.ids[: context.num_tokens], context)
        if key not in stored:  # store once: compress the document alone (query-agnostic) and record it
            start = time.perf_counter()
            doc = Encoded(encoded.ids[: context.num_tokens], encoded.text, context, context.num_tokens)
            engine.run(Request(document_of(example), 0, press=press, query_aware=False, quant=quant, reuse=writer,
                               encoded=doc))  # fmt: skip
            stored[key] = (int(store.stored_size(key) or 0), time.perf_counter() - start)
        reader = Engine(engine.model, engine.tokenizer, chunk_size=engine.chunk_size)  # ask many: a fresh engine
        request.reuse = DocumentReuse(store, reader.model_id, device=engine.model.device)
        pre, seq = prefill_request(reader, request, example.max_new_tokens)
        if not seq.plan.is_hit:
            raise RuntimeError(f"stored document {key} was not found again")  # the store evicted it: too small
        stored_bytes, store_s = stored[key]
        pre.columns = {
            "quant": quant,
            "stored_bytes": stored_bytes,
            "store_s": store_s,
            "load_s": seq.plan.info["load_s"],
        }
        return pre

    return Trial(stored_method(method, quant), ratio, prefill)


def stored_trials(
    methods: Sequence[str], ratios: Sequence[float], quants: Sequence[str] = QUANTS, store_url: str = "memory://"
) -> list[Trial]:
    """Stored trials for every method x ratio x quantisation (``full`` once per quantisation), ratio by ratio."""
    trials = [stored_trial(FULL, 0.0, q, store_url) for q in quants if FULL in methods]
    trials += [stored_trial(m, r, q, store_url) for r in ratios for m in methods if m != FULL for q in quants]
    return trials
