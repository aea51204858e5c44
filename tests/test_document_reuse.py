"""Compressed documents stored and reused: the same logits as an in-process compressed run, misses for other presses."""

from __future__ import annotations

import pytest
import torch

from kvforge.engine import PRESS_WITH_REUSE, Engine
from kvforge.errors import UserError
from kvforge.presses import build_press
from kvforge.request import Document, Request
from kvforge.reuse import DocumentReuse, SemanticReuse
from kvforge.reuse.base import PromptContext
from kvforge.store import open_store

DOC = "The vault code is 4812. The river runs north past the mill. " * 3
QUESTIONS = ["What is the vault code?", "Where does the river run?"]
PRESSES = [("kvzip", {}), ("knorm", {}), ("snapkv", {}), ("adakv", {})]  # adakv: head-wise (masked) layers


def _engine(model, tokenizer, store=None):
    engine = Engine(model, tokenizer, chunk_size=None)
    if store is not None:
        engine.reuse = DocumentReuse(store, engine.model_id)
    return engine


def _logits_in_process(engine, press, question):
    """Compress the document, prefill the question on it: the logits of the first answer token."""
    ctx_ids, q_ids = engine.encode_qa(DOC, question)
    cache, _ = engine.prefill(ctx_ids, press=press)
    _, logits = engine.prefill(q_ids, cache)
    return logits


def _prefilled(engine, press, question, quant=None, doc=DOC):
    """The engine's sequence for the question on the document, prefilled (plan, cache, last logits)."""
    request = Request(Document(doc, question), max_new_tokens=0, press=press, query_aware=False, quant=quant)
    seq = engine.add(request)
    engine.complete(seq)
    return seq


def _logits_from_store(engine, press, question, quant=None):
    _, q_ids = engine.encode_qa(DOC, question)
    seq = _prefilled(engine, press, question, quant)
    plan = seq.plan
    assert plan.is_hit and plan.prefill_ids == q_ids and plan.press_size == 0
    return seq.logits, plan


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("name", "options"), PRESSES)
def test_stored_document_gives_in_process_logits(model, tokenizer, tmp_path, name, options):
    press = build_press(name, compression_ratio=0.5, **options)
    store = open_store(f"file://{tmp_path}")
    first = _engine(model, tokenizer, store).answer(DOC, QUESTIONS[0], press=press, query_aware=False, max_new_tokens=4)
    assert first.reuse.kind == "miss" and len(store.keys()) == 1  # one segment: the compressed document
    fresh = _engine(model, tokenizer, open_store(f"file://{tmp_path}"))  # a new engine, strategy and store handle
    for question in QUESTIONS:
        stored, plan = _logits_from_store(fresh, press, question)
        expected = _logits_in_process(_engine(model, tokenizer), press, question)
        assert torch.equal(stored, expected)
        assert plan.document.compressed and plan.document.bytes_loaded > 0
        assert plan.document.kept_entries < plan.cache.num_layers * 2 * plan.reused_tokens  # really compressed
    # the whole answer: same tokens as the in-process query-agnostic run, the document reused
    again = fresh.answer(DOC, QUESTIONS[1], press=press, query_aware=False, max_new_tokens=4)
    alone = _engine(model, tokenizer).answer(DOC, QUESTIONS[1], press=press, query_aware=False, max_new_tokens=4)
    assert again.token_ids == alone.token_ids
    assert again.reused_tokens == len(fresh.encode_qa(DOC, QUESTIONS[1])[0]) and again.reuse.document.compressed
    # the facts as one JSON row: the document's own beside what every plan and the engine report
    assert set(again.reuse.as_dict()) == {
        "kind", "reused_tokens", "approximate", "document_key", "compressed", "press", "compression_ratio", "quant",
        "kept_entries", "bytes_loaded", "load_s", "plan_s", "record_s", "stored_writes", "lost_writes",
    }  # fmt: skip
    assert set(first.reuse.as_dict()) >= {"reason", "document_key"} and "compressed" not in first.reuse.as_dict()


@pytest.mark.usefixtures("one_thread")
def test_other_press_ratio_or_quant_is_a_miss(model, tokenizer):
    store = open_store("memory://")
    engine = _engine(model, tokenizer, store)
    stored = build_press("knorm", compression_ratio=0.5)
    engine.answer(DOC, QUESTIONS[0], press=stored, query_aware=False, max_new_tokens=1, quant="int4")

    def kind(press, quant):
        return _prefilled(engine, press, QUESTIONS[1], quant).plan.kind

    assert kind(build_press("knorm", compression_ratio=0.5), "int4") == "prefix"
    assert kind(build_press("knorm", compression_ratio=0.75), "int4") == "miss"  # ratio
    assert kind(build_press("snapkv", compression_ratio=0.5), "int4") == "miss"  # press
    assert kind(build_press("snapkv", compression_ratio=0.5, window_size=8), "int4") == "miss"  # parameter
    assert kind(build_press("knorm", compression_ratio=0.5), "int8") == "miss"  # quantisation
    assert kind(build_press("knorm", compression_ratio=0.5), None) == "miss"  # the store's own (none)
    assert kind(None, None) == "miss"  # no press: the exact prefix blocks, never the compressed document


@pytest.mark.usefixtures("one_thread")
def test_segment_whose_meta_disagrees_with_its_key_is_refused(model, tokenizer):
    store = open_store("memory://")
    engine = _engine(model, tokenizer, store)
    press = build_press("knorm", compression_ratio=0.5)
    engine.answer(DOC, QUESTIONS[0], press=press, query_aware=False, max_new_tokens=1)
    (key,) = store.keys()
    segment = store.get(key)
    segment.meta["press"]["compression_ratio"] = 0.25  # a writer that lied about what it stored
    store.put(key, segment)
    assert _prefilled(engine, press, QUESTIONS[1]).plan.kind == "miss"


@pytest.mark.usefixtures("one_thread")
def test_quantised_document_equals_its_roundtrip(model, tokenizer):
    """int4 storage of a compressed document: the loaded KV is what the codec's round trip gives."""
    from kvforge.store import quant_roundtrip

    store = open_store("memory://")
    engine = _engine(model, tokenizer, store)
    press = build_press("snapkv", compression_ratio=0.5)
    engine.answer(DOC, QUESTIONS[0], press=press, query_aware=False, max_new_tokens=1, quant="int4")
    ctx_ids, q_ids = engine.encode_qa(DOC, QUESTIONS[1])
    cache, _ = _engine(model, tokenizer).prefill(ctx_ids, press=press)
    expected = quant_roundtrip(cache.to_segment(engine.model_id, ctx_ids), "int4")
    context = PromptContext(DOC, len(ctx_ids), press=press, quant="int4")
    plan = engine.reuse.plan(ctx_ids + q_ids, context=context)  # the strategy's plan alone: the cache as loaded
    loaded = plan.cache.to_segment(engine.model_id, ctx_ids)
    assert all(torch.equal(a, b) for a, b in zip(loaded.keys, expected.keys, strict=True))
    assert plan.document.quant == "int4"
    assert not torch.equal(expected.keys[0], cache.to_segment().keys[0])  # int4 really changed the KV


def test_press_with_reuse_is_one_clear_error(model, tokenizer):
    engine = _engine(model, tokenizer, open_store("memory://"))
    press = build_press("knorm", compression_ratio=0.5)
    with pytest.raises(UserError, match="query-agnostic on a document"):
        engine.generate("hello there", max_new_tokens=1, press=press)
    with pytest.raises(UserError, match="query-agnostic on a document"):
        engine.answer(DOC, QUESTIONS[0], press=press, query_aware=True, max_new_tokens=1)
    from kvforge.reuse import FakeEmbedder

    engine.reuse = SemanticReuse(open_store("memory://"), engine.model_id, FakeEmbedder())
    with pytest.raises(UserError, match="query-agnostic on a document"):
        engine.answer(DOC, QUESTIONS[0], press=press, query_aware=False, max_new_tokens=1)
    assert "query_aware=False" in PRESS_WITH_REUSE


def test_cli_second_call_reuses_the_compressed_document(tiny_llama_dir, tmp_path, capsys):
    from kvforge.cli import main
    from kvforge.model import load_model

    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    base = ["generate", "--model", str(tiny_llama_dir), "--prompt-file", str(doc), "--max-new-tokens", "4",
            "--press", "kvzip", "--compression-ratio", "0.75", "--query-agnostic", "--reuse", "document",
            "--store", f"file://{tmp_path}/kv"]  # fmt: skip
    assert main([*base, "--prompt", QUESTIONS[0]]) == 0
    assert "compressed document stored" in capsys.readouterr().err
    assert main([*base, "--prompt", QUESTIONS[1]]) == 0  # a new engine and a reopened store, as a new process
    out, err = capsys.readouterr()
    assert "reused the compressed document" in err and "bytes loaded" in err and "TTFT" in err
    model, tokenizer = load_model(str(tiny_llama_dir))
    press = build_press("kvzip", compression_ratio=0.75)
    alone = Engine(model, tokenizer).answer(DOC, QUESTIONS[1], press=press, query_aware=False, max_new_tokens=4)
    assert out.strip() == alone.text.strip()
    # without --query-agnostic (or a document) the combination is the engine's error, before the model loads
    assert main([a for a in base if a != "--query-agnostic"] + ["--prompt", "q"]) == 2
    assert "query-agnostic on a document" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_stored_document_gives_in_process_logits_on_smollm2(smollm2, tmp_path):
    model, tokenizer = smollm2
    doc = ("The archive of the northern monastery holds 212 scrolls. The abbot, Brother Ansel, keeps the key to the "
           "reading room in a cedar box. Visitors may read on Tuesdays only. ") * 6  # fmt: skip
    press = build_press("knorm", compression_ratio=0.5)
    engine = Engine(model, tokenizer)
    engine.reuse = DocumentReuse(open_store(f"file://{tmp_path}"), engine.model_id)
    engine.answer(doc, "Who keeps the key?", press=press, query_aware=False, max_new_tokens=2)
    fresh = Engine(model, tokenizer)
    fresh.reuse = DocumentReuse(open_store(f"file://{tmp_path}"), fresh.model_id)
    question = "How many scrolls are there?"
    ctx_ids, q_ids = fresh.encode_qa(doc, question)
    seq = _prefilled(fresh, press, question, doc=doc)
    assert seq.plan.is_hit and seq.plan.document.compressed
    stored = seq.logits
    cache, _ = Engine(model, tokenizer).prefill(ctx_ids, press=press)
    _, expected = Engine(model, tokenizer).prefill(q_ids, cache)
    assert torch.equal(stored, expected)


def test_answer_many_with_a_store_goes_through_the_main_path(model, tokenizer, tmp_path):
    press = build_press("knorm", compression_ratio=0.5)
    engine = _engine(model, tokenizer, open_store(f"file://{tmp_path}"))
    many = engine.answer_many(DOC, QUESTIONS, press=press, max_new_tokens=4)
    plain = _engine(model, tokenizer)
    alone = [plain.answer(DOC, q, press=press, query_aware=False, max_new_tokens=4) for q in QUESTIONS]
    assert [g.token_ids for g in many] == [g.token_ids for g in alone]
    assert many[0].reuse.kind == "miss"  # the first answer stores the compressed document
    assert many[1].reused_tokens > 0 and many[1].reuse.document.compressed  # the second loads it
