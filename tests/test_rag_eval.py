"""RAG evaluation plumbing: metrics, data builders, rows and the normalised summary."""

import json

import pytest

from kvforge.rag import RagModel
from kvforge.rag.evaluate import (
    RagConfig,
    RagExample,
    contains,
    evaluate,
    load_musique,
    make_needle_examples,
    summarize,
    token_f1,
)
from kvforge.testing import tiny_model, tiny_tokenizer


def test_metrics():
    assert token_f1("Exeter College, Oxford", ["Exeter College"]) == pytest.approx(0.8)
    assert token_f1("the answer", ["nothing"]) == 0.0
    assert token_f1("The Beatles", ["beatles", "x"]) == 1.0
    assert contains("It is 1234567.", ["1234567"]) == 1.0 and contains("123456", ["1234567"]) == 0.0


def test_musique_loader(tmp_path):
    row = {"id": "q1", "question": "Who?", "answers": ["Ann"], "ctxs": [{"title": "T", "text": "a"},
                                                                         {"title": "", "text": "b"}]}
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(row | {"id": "q2"}) + "\n")
    exs = load_musique(path, limit=1)
    assert len(exs) == 1 and exs[0].docs == ["T\na", "b"] and exs[0].answers == ["Ann"] and exs[0].metric == "f1"


def test_needle_examples_hold_one_needle(tmp_path):
    path = tmp_path / "essays.jsonl"
    path.write_text("\n".join(json.dumps({"id": str(i), "text": "Some words here. " * 200}) for i in range(3)))
    exs = make_needle_examples(path, 4, num_docs=5, doc_chars=300, seed=1)
    assert exs == make_needle_examples(path, 4, num_docs=5, doc_chars=300, seed=1)  # deterministic
    for ex in exs:
        assert len(ex.docs) == 5 and ex.metric == "contains"
        holding = [d for d in ex.docs if ex.answers[0] in d]
        assert len(holding) == 1 and "special magic number" in holding[0]


def test_evaluate_and_summarize_on_a_tiny_model():
    rag = RagModel(tiny_model("llama"), tiny_tokenizer())
    exs = [RagExample("a", ["The code is 12.", "Cats nap."], "Code?", ["12"], "contains"),
           RagExample("b", ["Sky is blue.", "Grass is green."], "Sky?", ["blue"], "f1")]
    cfgs = [RagConfig("naive"), RagConfig("cacheclip", 1.0), RagConfig("cacheclip", 0.5, aux_name="self2")]
    rows = list(evaluate(rag, exs, cfgs, {"self2": rag}, max_new_tokens=3))
    assert [r["method"] for r in rows[:4]] == ["full", "naive", "cacheclip", "cacheclip:self2"]
    assert len(rows) == 8
    by = {(r["id"], r["method"], r["recompute_ratio"]): r for r in rows}
    for ex in ("a", "b"):  # r = 1 recomputes everything: the same greedy answer as full prefill
        assert by[(ex, "cacheclip", 1.0)]["prediction"] == by[(ex, "full", None)]["prediction"]
    summary = {(s["method"], s["recompute_ratio"]): s for s in summarize(rows)}
    assert summary[("full", None)]["recomputed_share"] == 1.0
    assert summary[("naive", None)]["recomputed_share"] == 0.0
    assert summary[("cacheclip", 1.0)]["recomputed_share"] == 1.0
    assert summary[("full", None)]["speedup_vs_full"] == pytest.approx(1.0)
    full_score = summary[("full", None)]["score"]
    if full_score:
        assert summary[("cacheclip", 1.0)]["quality_vs_full"] == pytest.approx(1.0)
