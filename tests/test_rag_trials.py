"""RAG chunk reuse rows from the one evaluation harness (``kvforge.eval.runner``), through ``Engine``."""

import pytest

from kvforge.engine import Engine
from kvforge.eval.data import Example
from kvforge.eval.runner import EvalRunner, chunk_trials
from kvforge.testing import tiny_model, tiny_tokenizer


def test_rag_rows_in_the_runner(tmp_path):
    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    examples = [Example(id="e1", context="", chunks=["The code is 12.", "Cats nap."], question="Code?",
                        answers=["12"], max_new_tokens=3)]
    trials = chunk_trials(["naive", "ape", "cacheblend", "cacheclip"], [0.2, 1.0])
    assert [(t.method, t.compression_ratio) for t in trials] == [
        ("full", 0.0), ("naive", 0.0), ("ape", 0.0), ("cacheblend", 0.2), ("cacheclip", 0.2), ("cacheblend", 1.0),
        ("cacheclip", 1.0)]
    rows = EvalRunner(engine, trials, tmp_path, {"model": "tiny"}).run(examples, progress=False)
    by = {(r["method"], r["compression_ratio"]): r for r in rows}
    assert len(rows) == 7
    assert by[("cacheclip", 1.0)]["prediction"] == by[("full", 0.0)]["prediction"]
    assert by[("cacheclip", 0.2)]["info"]["recompute_ratio"] == 0.2
    naive = by[("naive", 0.0)]["info"]
    assert naive["recomputed_tokens"] == 0 and naive["kind"] == "chunks" and naive["reused_tokens"] > 0
    # the prompt's length, not counting the generated tokens (APE places the chunks without separators)
    prompt = {r["prompt_tokens"] for r in rows if r["method"] != "ape"}
    assert prompt == {naive["reused_tokens"] + naive["fresh_tokens"]}
    assert by[("full", 0.0)]["info"]["kind"] == "miss"
    # the same columns as every other row of the harness
    assert len({tuple(sorted(r)) for r in rows}) == 1


def test_kvforge_eval_rag_flags(tmp_path, tiny_llama_dir):
    import json

    from kvforge.cli import main

    model_dir = tiny_llama_dir
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "e1", "chunks": ["The code is 12.", "Cats nap."], "question": "Code?",
                                "answers": ["12"], "max_new_tokens": 2}) + "\n")
    out = tmp_path / "out"
    argv = ["eval", "--model", str(model_dir), "--data", str(data), "--rag", "naive,cacheclip",
            "--recompute-ratios", "1.0", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by = {(r["method"], r["compression_ratio"]): r for r in rows}
    assert set(by) == {("full", 0.0), ("naive", 0.0), ("cacheclip", 1.0)}
    assert by[("cacheclip", 1.0)]["prediction"] == by[("full", 0.0)]["prediction"]
    assert by[("cacheclip", 1.0)]["info"]["recompute_ratio"] == 1.0
    summary = {r["method"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert summary["cacheclip"]["recompute_ratio"] == 1.0 and summary["naive"]["recompute_ratio"] == 0.0
    assert summary["cacheclip"]["score"] == summary["full"]["score"] and summary["cacheclip"]["ttft_speedup"] > 0
    assert "recompute %" in (out / "report.md").read_text()
    assert main([*argv[:5], "--rag", "blend", *argv[7:]]) == 2  # unknown strategy: one-line error


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rag", "blend"], "unknown RAG strategy"),
        (["--rag", "naive", "--recompute-ratios", "1.5"], "recompute-ratios"),
        (["--rag", "naive", "--query-agnostic"], "query-agnostic"),
        (["--rag", "naive", "--aux-model", "x"], "aux-model"),
        (["--aux-model", "x"], "aux-model"),
    ],
)
def test_kvforge_eval_rag_errors_before_any_model_loads(tmp_path, extra, message, capsys):
    from kvforge.cli import main

    argv = ["eval", "--model", str(tmp_path / "no-such-model"), "--task", "needle-docs", "--out", str(tmp_path / "o")]
    assert main([*argv, *extra]) == 2  # the model path does not exist: the options are checked first
    assert message in capsys.readouterr().err
