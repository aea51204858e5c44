"""The converted tasks run anywhere: without their data folder they read the small sample bundled in the package."""

import json
import logging

import pytest

from kvforge.cli import main
from kvforge.errors import UserError
from kvforge.eval.tasks import TASK_DATA, TaskConfig, build_task, check_task_data
from kvforge.paths import bundled_data_dir
from kvforge.testing import tiny_tokenizer

HAYSTACK = (bundled_data_dir() / "haystack_gutenberg" / "moby_dick_excerpt.txt").read_text(encoding="utf-8")
COUNTS = {"longbench-qa": 6, "longbench-summ": 2, "longbench": 8, "leval": 3, "squad": 5, "musique": 2,
          "semantic": 9, "semantic-long": 3}  # fmt: skip


def _flat(text: str) -> str:
    return " ".join(text.split())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "bundled sample" in r.message]


@pytest.mark.parametrize("name", sorted(TASK_DATA))
def test_a_missing_data_folder_falls_back_to_the_bundled_sample(tmp_path, caplog, name):
    caplog.set_level(logging.WARNING)
    examples = build_task(name, TaskConfig(tmp_path, tokenizer=tiny_tokenizer()))
    assert len(examples) == COUNTS[name] and len({e.id for e in examples}) == len(examples)
    assert all(e.question and e.answers and all(a.strip() for a in e.answers) for e in examples)
    (line,) = _warnings(caplog)  # one line, naming the folder and the way to the full data
    assert f"the data folder {tmp_path} has no {TASK_DATA[name]}/" in line and "--data-dir" in line
    build_task(name, TaskConfig(tmp_path))
    assert len(_warnings(caplog)) == 1  # said once per folder, not at each build
    (tmp_path / TASK_DATA[name]).mkdir()  # a data folder's own copy wins, even empty: an error or nothing
    try:
        assert build_task(name, TaskConfig(tmp_path)) == []
    except UserError as e:
        assert str(tmp_path / TASK_DATA[name]) in str(e)


def test_sample_contexts_are_passages_of_the_public_domain_excerpt():
    """Every sample context is text of the bundled Moby-Dick excerpt (prompt templates and passage labels aside);
    SQuAD answers are spans at their offsets; MuSiQue questions have 10 passages each."""
    flat = _flat(HAYSTACK)
    data = bundled_data_dir()
    for path in sorted((data / "longbench").glob("*.jsonl")):
        for row in map(json.loads, path.read_text().splitlines()):
            parts = [p.split("\n", 1)[-1] if p.startswith("Passage ") else p for p in row["context"].split("\n\n")]
            assert all(_flat(p) in flat for p in parts), path
    for row in map(json.loads, (data / "leval_multiquestion" / "narrative_qa.jsonl").read_text().splitlines()):
        assert _flat(row["input"]) in flat and len(row["instructions"]) == len(row["outputs"]) == 3
    for row in map(json.loads, (data / "squad_v2_dev" / "dev.jsonl").read_text().splitlines()):
        assert _flat(row["context"]) in flat
        for qa in row["qas"]:
            spans = zip(qa["answers"], qa["answer_starts"], strict=True)
            assert all(row["context"][s : s + len(a)] == a for a, s in spans)
    for row in map(json.loads, (data / "musique_rag" / "musique_s.jsonl").read_text().splitlines()):
        assert len(row["ctxs"]) == 10 and all(_flat(c["text"]) in flat for c in row["ctxs"])
        assert any(a.lower() in _flat(c["text"]).lower() for c in row["ctxs"] for a in row["answers"])
    total = sum(f.stat().st_size for d in TASK_DATA.values() for f in (data / d).iterdir())
    assert total < 200_000


def test_check_task_data_accepts_a_missing_folder_and_warns_before_the_model_loads(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    check_task_data(["needle", "squad", "musique"], tmp_path)
    assert [w.split(":")[0] for w in _warnings(caplog)] == [
        f"the data folder {tmp_path} has no squad_v2_dev/", f"the data folder {tmp_path} has no musique_rag/"
    ]  # fmt: skip


def test_no_data_folder_at_all_speaks_to_an_installed_user(caplog):
    from kvforge.paths import NO_DATA_DIR

    caplog.set_level(logging.WARNING)
    check_task_data(["squad"], NO_DATA_DIR)
    (line,) = _warnings(caplog)
    assert line.startswith("no evaluation data folder was given or found: using the small bundled sample")
    assert "--data-dir DIR" in line and "shared" not in line


def test_cli_eval_squad_runs_end_to_end_on_the_sample(tmp_path, tiny_llama_dir, caplog):
    caplog.set_level(logging.WARNING)
    out = tmp_path / "out"
    argv = ["eval", "--model", str(tiny_llama_dir), "--task", "squad", "--data-dir", str(tmp_path / "none"),
            "--methods", "full,snapkv", "--compression-ratios", "0.5", "--max-new-tokens", "2", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * COUNTS["squad"] and {r["task"] for r in rows} == {"squad"}
    assert len(_warnings(caplog)) == 1 and (out / "report.md").is_file()
