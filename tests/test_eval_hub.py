"""hub: tasks read parquet (no loading script, no trust_remote_code), tested with a fake `datasets` module and, where
`datasets` is installed, a real local parquet file."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from kvforge.eval.tasks import TaskConfig, build_task

LONGBENCH_ROW = {"_id": "lb-1", "input": "Who wrote it?", "context": "A long passage. " * 5, "answers": ["Ann"],
                 "length": 10, "dataset": "hotpotqa", "language": "en", "all_classes": None}  # fmt: skip


@pytest.fixture()
def fake_datasets(monkeypatch):
    calls = []
    module = types.ModuleType("datasets")

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        if args[0] == "rajpurkar/squad_v2":
            return [{"id": "q1", "context": "Paris is in France.", "question": "Where is Paris?",
                     "answers": {"text": ["France"], "answer_start": [12]}}]  # fmt: skip
        return [dict(LONGBENCH_ROW)]

    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)
    monkeypatch.delenv("KVFORGE_HUB_LONGBENCH", raising=False)
    return calls


def test_longbench_reads_the_parquet_conversion_without_a_loading_script(fake_datasets, tmp_path):
    (example,) = build_task("hub:longbench/hotpotqa", TaskConfig(tmp_path))
    ((args, kwargs),) = fake_datasets
    assert args == ("parquet",) and "trust_remote_code" not in kwargs and kwargs["split"] == "train"
    assert kwargs["data_files"] == "hf://datasets/THUDM/LongBench@refs%2Fconvert%2Fparquet/hotpotqa/test/*.parquet"
    assert example.id == "lb-1" and example.answers == ["Ann"] and "Who wrote it?" in example.question
    assert example.task == "longbench-qa" and example.metric == "f1"


def test_a_mirror_or_local_files_replace_the_hub(fake_datasets, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_HUB_LONGBENCH", str(tmp_path / "{subset}.parquet"))
    build_task("hub:longbench/qasper", TaskConfig(tmp_path))
    assert fake_datasets[0][1]["data_files"] == str(tmp_path / "qasper.parquet")


def test_squad_v2_is_a_plain_data_repository(fake_datasets, tmp_path):
    (example,) = build_task("hub:squad_v2", TaskConfig(tmp_path))
    assert fake_datasets == [(("rajpurkar/squad_v2",), {"split": "validation"})]
    assert example.answers == ["France"] and example.task == "squad"


def test_without_datasets_the_error_names_the_extra(monkeypatch, tmp_path):
    from kvforge.errors import UserError

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserError, match=r"pip install 'kvforge\[hub\]'"):
        build_task("hub:squad_v2", TaskConfig(tmp_path))


def test_a_real_local_parquet_file(tmp_path, monkeypatch):
    pytest.importorskip("datasets", reason="the hub extra is not installed (pip install 'kvforge[hub]')")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([LONGBENCH_ROW]), tmp_path / "hotpotqa.parquet")
    monkeypatch.setenv("KVFORGE_HUB_LONGBENCH", str(tmp_path / "{subset}.parquet"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (example,) = build_task("hub:longbench/hotpotqa", TaskConfig(Path(tmp_path)))
    assert example.id == "lb-1" and example.answers == ["Ann"]
