import json

import pytest

from kvforge.errors import UserError
from kvforge.eval.data import DataFormatError, Example, read_examples, write_examples
from kvforge.eval.metrics import (
    contains,
    contains_all,
    exact_match,
    f1,
    normalize_answer,
    normalized_score,
    rouge_l,
    score_prediction,
)


def _write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_fields_ignores_unknown_and_joins_chunks(tmp_path):
    rows = [
        {"id": "a", "context": "ctx", "question": "q?", "answers": ["x"], "metric": "f1", "extra": {"k": 1}},
        {
            "id": "b",
            "chunks": ["d1", "d2"],
            "question": "q",
            "answers": [],
            "max_new_tokens": 8,
            "system": "s",
            "answer_prefix": "A:",
            "task": "rag",
        },
    ]
    examples = read_examples(_write(tmp_path, [json.dumps(r) for r in rows] + [""]))
    assert examples[0] == Example(id="a", context="ctx", question="q?", answers=["x"], metric="f1")
    b = examples[1]
    assert (b.context, b.chunks, b.max_new_tokens, b.system, b.answer_prefix, b.task) == (
        "d1\n\nd2",
        ["d1", "d2"],
        8,
        "s",
        "A:",
        "rag",
    )


def test_roundtrip(tmp_path):
    ex = [
        Example(id="1", context="c", question="q", answers=["a", "b"], metric="em", needles=["c"]),
        Example(id="2", context="x\n\ny", question="q", answers=["a"], chunks=["x", "y"], answer_prefix="P"),
    ]
    assert read_examples(write_examples(ex, tmp_path / "o.jsonl")) == ex


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ('["a"]', "expected a JSON object"),
        ('{"id": "x", "question": "q", "answers": ["a"]}', "'context'"),
        ('{"id": "x", "context": "c", "question": "q"}', "'answers'"),
        ('{"id": "x", "context": "c", "question": "q", "answers": "a"}', "'answers' must be a list"),
        ('{"id": "x", "context": "c", "question": "q", "answers": ["a"], "metric": "bleu"}', "unknown metric"),
        ('{"id": "x", "context": "c", "question": "q", "answers": ["a"], "max_new_tokens": 0}', "max_new_tokens"),
        ('{"id": 3, "context": "c", "question": "q", "answers": ["a"]}', "'id'"),
        ('{"id": "a", "context": "c", "question": "q", "answers": ["a"]}', "duplicate id"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    good = '{"id": "a", "context": "c", "question": "q", "answers": ["a"]}'
    path = _write(tmp_path, [good, "", line])
    with pytest.raises(DataFormatError, match=message) as info:
        read_examples(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert isinstance(info.value, UserError)


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(DataFormatError, match="cannot read"):
        read_examples(tmp_path / "nope.jsonl")
    with pytest.raises(DataFormatError, match="no examples"):
        read_examples(_write(tmp_path, [""]))


def test_limit(tmp_path):
    lines = [json.dumps({"id": str(i), "context": "c", "question": "q", "answers": ["a"]}) for i in range(5)]
    assert [e.id for e in read_examples(_write(tmp_path, lines), limit=2)] == ["0", "1"]


def test_normalize_answer():
    assert normalize_answer("  The Eiffel-Tower, in PARIS! ") == "eiffeltower in paris"


def test_contains_whole_words():
    assert contains("The magic number is 7,234,111.", ["7234111"]) == 1.0
    assert contains("The answer is Paris", ["paris", "London"]) == 1.0
    assert contains("Parisian food", ["Paris"]) == 0.0
    assert contains("anything", []) == 0.0


def test_contains_all_fraction():
    assert contains_all("values: 12, 34 and 99", ["12", "34", "56", "78"]) == 0.5
    assert contains_all("none", ["1"]) == 0.0


def test_exact_match():
    assert exact_match("The Beatles.", ["beatles", "x"]) == 1.0
    assert exact_match("The Beatles band", ["beatles"]) == 0.0
    assert exact_match("", []) == 1.0


def test_f1_by_hand():
    # pred tokens: [paris, france, capital]; ref tokens: [paris, capital, city, france, europe] -> common 3
    # precision 3/3, recall 3/5 -> F1 = 2*1*0.6/1.6 = 0.75
    assert f1("Paris, France: the capital", ["Paris, capital city: France (Europe)", "London"]) == pytest.approx(0.75)
    # "is", "of", "in" count too: ref = [paris, is, capital, city, of, france, in, europe] (8) -> 2*1*(3/8)/(1+3/8)
    assert f1("paris france capital", ["Paris is capital city of France in Europe"]) == pytest.approx(2 * 0.375 / 1.375)
    assert f1("nothing", ["something"]) == 0.0
    assert f1("", []) == 1.0


def test_rouge_l_by_hand():
    # LCS("the cat sat on the mat", "the cat lay on the mat") = the cat on the mat = 5 of 6 -> P = R = F = 5/6
    assert rouge_l("the cat sat on the mat", ["the cat lay on the mat"]) == pytest.approx(5 / 6)
    # LCS = 2 (a b) of pred 2, ref 4 -> P=1, R=0.5, F=2/3
    assert rouge_l("a b", ["a x b y", "z"]) == pytest.approx(2 / 3)


def test_score_prediction_dispatch_and_normalized():
    assert score_prediction("Paris", ["paris"], "em") == 1.0
    with pytest.raises(ValueError, match="unknown metric"):
        score_prediction("a", ["a"], "bleu")
    assert normalized_score(0.3, 0.6) == pytest.approx(50.0)
    assert normalized_score(0.3, 0.0) is None
