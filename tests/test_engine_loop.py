"""The one loop: Engine.run equals the stages run by hand, requests of every kind stepped together equal each alone,
reuse hits start first without starving long prompts, deadlines end a request, failures stay with their request."""

from __future__ import annotations

import time

import pytest
import torch

from kvforge.cache import KVCache
from kvforge.decode import DecodeState, decode
from kvforge.engine import Engine
from kvforge.errors import Aborted
from kvforge.presses import build_press
from kvforge.request import Chunks, Document, Request
from kvforge.reuse import DocumentReuse, PrefixReuse
from kvforge.reuse.rag import ChunkReuse
from kvforge.store.memory import MemoryStore
from kvforge.testing import tiny_model, tiny_tokenizer

DOC = "The vault code is 4812. The river runs north past the old mill. " * 3
QUESTION = "What is the vault code?"
CHUNKS = ["The cat sat on the mat all day.", "Paris is the capital of France.", "The code is 7731, remember it."]
NEW = 8


def _engine(arch: str = "llama", **kwargs: object) -> Engine:
    engine = Engine(tiny_model(arch), tiny_tokenizer(), chunk_size=16, **kwargs)  # type: ignore[arg-type]
    engine.eos_token_ids = []  # every answer runs to its budget: the comparisons see every token
    return engine


def _by_hand(engine: Engine, cache: KVCache, logits: torch.Tensor) -> list[int]:
    return decode(engine.model, cache, logits, DecodeState(NEW)).token_ids


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_run_equals_the_stages_run_by_hand(arch: str) -> None:
    """Plain, query-aware press, query-agnostic press (document compressed, then the question): engine.run gives the
    tokens of prefill (under the press) + decode composed by hand."""
    engine = _engine(arch)
    press = build_press("snapkv", compression_ratio=0.5, window_size=4)
    ctx_ids, q_ids = engine.encode_qa(DOC, QUESTION)
    ids = engine.encode_chat("Tell me about the sea.")
    assert engine.run(Request(ids, NEW)).token_ids == _by_hand(engine, *engine.prefill(ids))
    aware = engine.run(Request(Document(DOC, QUESTION), NEW, press=press))
    assert aware.token_ids == _by_hand(engine, *engine.prefill(ctx_ids + q_ids, press=press))
    agnostic = engine.run(Request(Document(DOC, QUESTION), NEW, press=press, query_aware=False))
    cache, _ = engine.prefill(ctx_ids, press=press)
    assert agnostic.token_ids == _by_hand(engine, *engine.prefill(q_ids, cache))
    assert agnostic.info["press"]["compressed_tokens"] == len(ctx_ids)  # the press saw the document only


def test_reuse_hits_equal_a_full_prefill() -> None:
    """A prefix hit and a stored compressed document: the second run loads, prefills the rest, answers alike."""
    engine = _engine()
    prefix = PrefixReuse(MemoryStore(), engine.model_id, block_size=16)
    ids = engine.encode_chat(DOC + QUESTION)
    first, second = (engine.run(Request(ids, NEW, reuse=prefix)) for _ in range(2))
    assert first.reused_tokens == 0 and second.reused_tokens > 0
    assert first.token_ids == second.token_ids == _by_hand(engine, *engine.prefill(ids))
    press = build_press("knorm", compression_ratio=0.5)
    documents = DocumentReuse(MemoryStore(), engine.model_id)
    request = Request(Document(DOC, QUESTION), NEW, press=press, query_aware=False, reuse=documents)
    stored, loaded = engine.run(request), engine.run(Request(**{**vars(request), "encoded": None}))
    assert stored.reuse.kind == "miss" and loaded.reuse.document.compressed
    assert stored.token_ids == loaded.token_ids


def _mixed_requests(engine: Engine) -> list[Request]:
    """One request of each kind: plain, query-aware press, stored compressed document (a hit), RAG chunks, sampled."""
    from kvforge.decode import SamplingParams

    press = build_press("knorm", compression_ratio=0.5)
    documents = DocumentReuse(MemoryStore(), engine.model_id)
    engine.run(Request(Document(DOC, None), 0, press=press, query_aware=False, reuse=documents))  # stored once
    rag = ChunkReuse(engine.model, engine.tokenizer, method="cacheblend", recompute_ratio=0.3)
    return [
        Request("Tell me about the sea.", NEW),
        Request(Document(DOC, QUESTION), NEW, press=build_press("snapkv", 0.5, window_size=4)),
        Request(Document(DOC, "Where does the river run?"), NEW, press=press, query_aware=False, reuse=documents),
        Request(Chunks(CHUNKS, "What is the code?"), NEW, reuse=rag),
        Request("Once upon a time", NEW, sampling=SamplingParams(temperature=0.9, seed=5)),
        Request(engine.encode_chat("x" * 70), NEW),  # a longer prompt: prefilled over several steps
    ]


def _fresh(request: Request) -> Request:
    return Request(**{**vars(request), "encoded": None})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_requests_of_every_kind_stepped_together_equal_each_alone(arch: str) -> None:
    """A compressed document (loaded from the store), a RAG request, a press request and plain ones decode in one
    forward per step and give each exactly its lone tokens."""
    engine = _engine(arch, prefill_budget=8)
    requests = _mixed_requests(engine)
    steps = engine.stats["steps"]
    alone = [engine.run(_fresh(r)).token_ids for r in requests]
    steps_alone, rows = engine.stats["steps"] - steps, engine.stats["decode_rows"]
    together = [g.token_ids for g in engine.run_many([_fresh(r) for r in requests])]
    assert together == alone
    assert engine.stats["steps"] - steps - steps_alone < steps_alone * 3 / 4  # forwards shared by the requests
    assert engine.stats["decode_rows"] - rows == len(requests) * (NEW - 1)  # every token but the last fed back


def test_a_reuse_hit_starts_before_a_long_new_prompt_which_still_progresses() -> None:
    engine = _engine(prefill_budget=8)
    prefix = PrefixReuse(MemoryStore(), engine.model_id, block_size=16)
    hit_ids = engine.encode_chat(DOC)
    engine.run(Request(hit_ids, 1, reuse=prefix))  # stored
    long = engine.add(Request(engine.encode_chat("y" * 200), 2, reuse=False))
    engine.step()  # the long prompt starts alone: a chunk of chunk_size
    hit = engine.add(Request(hit_ids, 2, reuse=prefix))
    assert hit.num_prompt_left < long.num_prompt_left
    lefts = []
    while hit.prefilled_at is None:
        before = long.num_prompt_left
        engine.step()
        lefts.append(before - long.num_prompt_left)
    assert long.prefilled_at is None  # the hit finished its prompt first...
    assert all(n >= 8 // 4 for n in lefts)  # ...while the long prompt got its share of every step
    assert engine.complete(long).token_ids and engine.complete(hit).token_ids


def test_deadline_and_abort_end_only_their_request() -> None:
    engine = _engine()
    late = engine.add(Request("a" * 40, 50, deadline=time.monotonic() - 1))
    left = engine.add(Request("b" * 40, 50))
    going = engine.add(Request("c" * 10, 3))
    done = engine.step()
    assert late in done and isinstance(late.error, Aborted) and late.error.reason == "timeout"
    engine.abort(left, Aborted("cancelled"))
    with pytest.raises(Aborted):
        left.result()
    assert len(engine.complete(going).token_ids) == 3 and not engine.running


def test_a_failed_forward_fails_its_step_and_the_engine_goes_on() -> None:
    engine = _engine()
    fail = {"now": True}

    def boom(module: object, args: object) -> None:
        if fail["now"]:
            raise RuntimeError("boom")

    hook = engine.model.register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.run(Request("hello", 3))
        fail["now"] = False
        assert len(engine.run(Request("hello", 3)).token_ids) == 3 and not engine.running
    finally:
        hook.remove()


def test_a_request_is_tokenised_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvforge.engine

    engine = _engine()
    calls: list[object] = []
    real = kvforge.engine.encode
    monkeypatch.setattr(kvforge.engine, "encode", lambda tok, req: calls.append(req) or real(tok, req))
    request = Request(Document(DOC, QUESTION), NEW)
    engine.encode(request)  # what the server does off the model thread
    engine.run(request)  # add uses the tokens the request carries
    assert calls == [request]
    engine.run(Request("hello", 2))  # a request not tokenised yet is tokenised by add, once
    assert len(calls) == 2


def test_store_only_request_records_the_document_and_generates_nothing() -> None:
    engine = _engine()
    documents = DocumentReuse(MemoryStore(), engine.model_id)
    press = build_press("knorm", compression_ratio=0.5)
    gen = engine.run(Request(Document(DOC, None), 0, press=press, query_aware=False, reuse=documents))
    assert gen.token_ids == [] and len(documents.store.keys()) == 1
    again = engine.run(Request(Document(DOC, None), 0, press=press, query_aware=False, reuse=documents))
    assert again.reuse.kind == "prefix" and len(documents.store.keys()) == 1
    with pytest.raises(Exception, match="only stored"):
        Request(Document(DOC, None), 3)
