import json

import pytest

from kvforge.errors import UserError
from kvforge.eval.data import example_from_json, read_examples, write_examples
from kvforge.eval.tasks import TASKS, TaskConfig, build_task, check_task_data
from kvforge.eval.tasks.base import Measure, interleave, truncate_middle
from kvforge.eval.tasks.longbench import longbench_example
from kvforge.eval.tasks.musique import musique_example
from kvforge.eval.tasks.needle import insert_needles, read_haystack
from kvforge.eval.tasks.squad import squad_examples
from kvforge.paths import bundled_data_dir, default_data_dir, haystack_files
from kvforge.testing import tiny_tokenizer

DATA = default_data_dir()
needs_data = pytest.mark.skipif(
    not (DATA / "longbench").is_dir(), reason="needs the evaluation data (LongBench, L-Eval, SQuAD, MuSiQue samples)"
)
SYNTHETIC = ["needle", "ruler-mk", "ruler-mv", "ruler-mq", "ruler-vt", "ruler-cwe"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _cfg(tok, **kw):
    return TaskConfig(DATA, tokenizer=tok, **({"lengths": (512,), "depths": (0.0, 0.5, 1.0)} | kw))


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_tasks_are_deterministic_for_a_seed(tok, name):
    first, again = build_task(name, _cfg(tok)), build_task(name, _cfg(tok))
    assert first == again
    other = build_task(name, _cfg(tok, seed=1))
    assert [e.id for e in other] == [e.id for e in first]
    assert [e.context for e in other] != [e.context for e in first]


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_answers_are_in_context_and_length_is_close(tok, name):
    measure = Measure(tok)
    for ex in build_task(name, _cfg(tok)):
        for answer in ex.answers:
            assert answer in ex.context
        for needle in ex.needles:
            assert needle in ex.context
        assert abs(measure.size(ex.context) - 512) <= 20, ex.id


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.33, 0.5, 0.9, 1.0])
def test_needle_sits_at_requested_depth_in_tokens(tok, depth):
    measure = Measure(tok)
    (ex,) = build_task("needle", _cfg(tok, lengths=(2000,), depths=(depth,)))
    (needle,) = ex.needles
    start = ex.context.index(needle)
    hay_size = measure.size(ex.context) - measure.size(needle)
    # snapped to the nearest sentence boundary: within SNAP_WINDOW (200) characters of 2000 = 0.1, usually far less
    assert abs(measure.size(ex.context[:start]) / hay_size - depth) <= 0.1


def test_insert_needles_exact_depth_without_snapping(tok):
    measure = Measure(tok)
    hay = "abcdefghij" * 40  # 400 units with the character tokenizer
    for depth in (0.0, 0.25, 0.5, 0.8, 1.0):
        context, (start,) = insert_needles(hay, ["NEEDLE"], [depth], measure, snap=False)
        assert context[start : start + 6] == "NEEDLE"
        assert context.replace(" NEEDLE ", "").replace("NEEDLE ", "").replace(" NEEDLE", "") == hay
        assert len(context[:start].rstrip(" ")) == round(depth * 400)


def test_insert_needles_snaps_to_sentence_and_keeps_order(tok):
    measure = Measure(tok)
    hay = "One two three. Four five six. Seven eight nine. "
    context, starts = insert_needles(hay, ["X.", "Y."], [0.55, 0.2], measure)
    assert context == "One two three. Y. Four five six. X. Seven eight nine. "
    assert [context[s : s + 2] for s in starts] == ["X.", "Y."]


def test_lengths_in_characters_without_tokenizer():
    (ex,) = build_task("needle", TaskConfig(DATA, lengths=(800,), depths=(0.5,)))
    assert abs(len(ex.context) - 800) <= 2


def test_ruler_mix_interleaves_all_tasks(tok):
    examples = build_task("ruler", _cfg(tok, depths=(0.5,)))
    assert [e.task for e in examples] == SYNTHETIC


def test_interleave_drops_repeated_ids(tok):
    """`--task needle,ruler`: ruler's single needles are the needle task's examples; each is kept once."""
    cfg = _cfg(tok, depths=(0.5,), num_samples=2)
    needles, mix = build_task("needle", cfg), build_task("ruler", cfg)
    assert {e.id for e in needles} <= {e.id for e in mix}
    merged = interleave([needles, mix])
    assert len({e.id for e in merged}) == len(merged) == len(mix)
    assert [e.id for e in merged[:3]] == [needles[0].id, needles[1].id, mix[1].id]  # mix[0] is needles[0]


@needs_data
@pytest.mark.parametrize("name", ["longbench-qa", "longbench-summ", "leval", "squad", "musique"])
def test_converters_write_valid_rows(tmp_path, tok, name):
    examples = build_task(name, TaskConfig(DATA, tokenizer=tok, max_context_size=300))[:20]
    assert examples
    assert len({e.id for e in examples}) == len(examples)
    assert read_examples(write_examples(examples, tmp_path / "x.jsonl")) == examples
    for e in examples:
        assert e.question and e.answers and e.task.startswith(name.split("-")[0])


def test_longbench_row_keeps_prompt_and_truncates_middle(tok):
    row = {"_id": "x", "dataset": "hotpotqa", "input": "Who?", "context": "A" * 100 + "B" * 100, "answers": ["Bob"]}
    ex = longbench_example(row, Measure(tok), max_context_size=20)
    assert ex.context.endswith("The following are given passages.\n" + "A" * 10 + "B" * 10)
    assert ex.question.startswith("Answer the question based on the given passages.")
    assert ex.question.endswith("Question: Who?\nAnswer:")
    assert (ex.metric, ex.max_new_tokens, ex.task) == ("f1", 32, "longbench-qa")
    assert longbench_example(row | {"dataset": "gov_report"}, Measure(tok)).metric == "rouge_l"


def test_truncate_middle(tok):
    assert truncate_middle("0123456789", 4, Measure(tok)) == "0189"
    assert truncate_middle("0123456789", 4, Measure(None)) == "0189"
    assert truncate_middle("0123", 4, Measure(tok)) == "0123"


def test_squad_and_musique_rows():
    para = {"context": "Paris is in France.", "qas": [
        {"id": "1", "question": "Where?", "answers": ["France"], "is_impossible": False},
        {"id": "2", "question": "Why?", "answers": [], "is_impossible": True}]}  # fmt: skip
    (ex,) = squad_examples(para)
    assert (ex.id, ex.context, ex.answers, ex.metric) == ("1", "Paris is in France.", ["France"], "f1")
    row = {
        "id": "m",
        "question": "Q?",
        "answers": ["a"],
        "ctxs": [{"title": "T", "text": "x"}, {"title": "", "text": "y"}],
    }
    ex = musique_example(row)
    assert ex.chunks == ["Title: T\nx", "y"]
    assert example_from_json(json.loads(json.dumps(ex.to_json()))) == ex


def test_unknown_task_and_missing_data(tmp_path):
    with pytest.raises(UserError, match="unknown task"):
        build_task("nope", TaskConfig(tmp_path))
    (tmp_path / "squad_v2_dev").mkdir()  # a folder without its file (no folder at all: the bundled sample)
    with pytest.raises(UserError, match=r"dev\.jsonl not found"):
        build_task("squad", TaskConfig(tmp_path))
    with pytest.raises(UserError, match="haystack file"):
        build_task("needle", TaskConfig(tmp_path, haystack=(tmp_path / "missing.txt",)))
    assert set(SYNTHETIC) <= set(TASKS)


def test_generated_tasks_fall_back_to_the_bundled_haystack(tmp_path, tok):
    """An empty data folder: needle/RULER tasks use the public-domain excerpt shipped in the package."""
    assert haystack_files(tmp_path) == haystack_files(None)
    (bundled,) = haystack_files(tmp_path)
    assert bundled.parent.parent == bundled_data_dir() and bundled.stat().st_size > 50_000
    (ex,) = build_task("needle", TaskConfig(tmp_path, tokenizer=tok, lengths=(300,), depths=(0.5,)))
    assert ex.needles[0] in ex.context and "Ishmael" in read_haystack((bundled,))
    hay_dir = tmp_path / "haystack_mine"
    hay_dir.mkdir()
    (hay_dir / "t.txt").write_text("x " * 1000)
    assert haystack_files(tmp_path) == [hay_dir / "t.txt"]  # a data folder's own haystack wins


def test_task_names_are_checked_before_any_model_loads(tmp_path):
    check_task_data(["needle", "ruler", "needle-docs"], tmp_path)  # generated: nothing needed
    check_task_data(["needle", "longbench-qa"], tmp_path)  # converted: the bundled sample (tests/test_eval_samples.py)
    with pytest.raises(UserError, match="unknown task 'nedle'"):
        check_task_data(["nedle"], tmp_path)


@pytest.mark.parametrize("depth", [0.0, 0.45, 1.0])
def test_needle_docs_split_the_needle_context_into_whole_documents(tok, depth):
    """needle-docs: the single-needle context in 10 chunks at sentence boundaries; the needle whole, in the
    document at its depth; same as the needle task otherwise (deterministic)."""
    cfg = _cfg(tok, lengths=(8000,), depths=(depth,))  # documents of ~800 characters (real: ~1.6k at 4k tokens)
    (ex,), (base,) = build_task("needle-docs", cfg), build_task("needle", cfg)
    assert build_task("needle-docs", cfg) == [ex] and ex.task == "needle-docs"
    assert len(ex.chunks) == 10 and all(c == c.strip() and c for c in ex.chunks)
    assert " ".join(ex.chunks).split() == base.context.split()  # nothing lost, nothing cut mid-sentence
    ends = (".", "?", "!", '"', "'", "\u201d", "\u2019")
    assert all(c.endswith(ends) for c in ex.chunks[:-1]), ex.chunks
    (needle,) = ex.needles
    holder = [i for i, c in enumerate(ex.chunks) if needle in c]
    assert len(holder) == 1 and abs(holder[0] - depth * 9) <= 1.5
    assert (ex.question, ex.answers, ex.answer_prefix) == (base.question, base.answers, base.answer_prefix)
    assert example_from_json(json.loads(json.dumps(ex.to_json()))).chunks == ex.chunks


def test_narrative_needle_docs_keep_each_wording_whole_in_one_document(tok):
    """needle-narrative-docs: the needle-narrative contexts (wordings in turn) in 10 documents, nothing lost."""
    cfg = _cfg(tok, lengths=(8000,), depths=(0.3, 0.7))
    docs, base = build_task("needle-narrative-docs", cfg), build_task("needle-narrative", cfg)
    assert len(docs) == 2 and len({ex.id.split("-L")[0] for ex in docs}) == 2  # two wordings
    for ex, b in zip(docs, base, strict=True):
        assert ex.task == "needle-narrative-docs" and ex.id == b.id.replace("narrative-", "narrative-docs-", 1)
        assert len(ex.chunks) == 10 and " ".join(ex.chunks).split() == b.context.split()
        assert sum(ex.needles[0] in c for c in ex.chunks) == 1 and (ex.question, ex.answers) == (b.question, b.answers)


def test_narrative_needles_are_plain_statements_at_sentence_ends_in_their_own_words(tok):
    """needle-narrative: each cell its own wording (none RULER's template), the needle whole and at a sentence end,
    the question names its key, the answer is in the needle; deterministic for a seed."""
    from kvforge.eval.tasks.needle import WORDINGS

    cfg = _cfg(tok, lengths=(1500,), depths=(0.0, 0.25, 0.5, 0.75, 1.0), num_samples=2)
    examples = build_task("needle-narrative", cfg)
    assert examples == build_task("needle-narrative", cfg) and len(examples) == 10
    assert len({e.id.split("-")[2] for e in examples}) == len(WORDINGS)  # every wording is used
    for ex in examples:
        (needle,) = ex.needles
        assert "magic number" not in needle and ex.answers[0] in needle and needle in ex.context
        start = ex.context.index(needle)
        assert start == 0 or ex.context[:start].rstrip()[-1] in ".!?\"'\u201d\u2019"  # after a sentence end
        who = needle.split(" ")[:2] if needle.split(" ")[0] in ("Mr.", "Mrs.", "Miss", "Captain", "Doctor") else None
        assert who is None or " ".join(who) in ex.question
        assert abs(Measure(tok).size(ex.context) - 1500) <= 4


def test_narrative_multi_needles_share_one_document(tok):
    examples = build_task("needle-multi-narrative", _cfg(tok, lengths=(2000,)))
    assert len(examples) == 4 and len({e.context for e in examples}) == 1
    assert len({e.question for e in examples}) == 4 and all(e.needles[0] in e.context for e in examples)


def test_haystack_row_of_a_jsonl_file(tmp_path, tok):
    books = tmp_path / "books.jsonl"
    books.write_text("\n".join(json.dumps({"id": i, "text": f"Book {i}. " * 300}) for i in ("a", "b")))
    assert "Book b" in read_haystack((tmp_path / "books.jsonl#b",)) and "Book a" not in read_haystack(
        (tmp_path / "books.jsonl#b",))  # fmt: skip
    with pytest.raises(UserError, match="no row with id 'c'"):
        read_haystack((tmp_path / "books.jsonl#c",))
    (ex,) = build_task("needle-narrative", TaskConfig(tmp_path, tokenizer=tok, lengths=(300,), depths=(0.5,),
                                                      haystack=(tmp_path / "books.jsonl#a",)))  # fmt: skip
    assert "Book a" in ex.context and "Book b" not in ex.context
