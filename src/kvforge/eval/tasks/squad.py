"""SQuAD 2.0 dev (``data_dir/squad_v2_dev``): short-context QA, one example per answerable question."""

from __future__ import annotations

from typing import Any

from kvforge.eval.data import Example
from kvforge.eval.tasks.base import TaskConfig, read_jsonl
from kvforge.paths import task_data_folder


def squad_examples(row: dict[str, Any], include_impossible: bool = False) -> list[Example]:
    """One paragraph's questions (token F1; unanswerable ones skipped unless ``include_impossible``)."""
    return [
        Example(
            id=str(qa["id"]),
            context=row["context"],
            question=f"Question: {qa['question']}\nAnswer with a short span copied from the text.",
            answers=list(qa["answers"]),
            metric="f1",
            task="squad",
            max_new_tokens=32,
        )
        for qa in row["qas"]
        if include_impossible or not qa.get("is_impossible")
    ]


def squad_task(cfg: TaskConfig) -> list[Example]:
    """All answerable shared questions, paragraph by paragraph, shuffled by the seed (paragraphs stay together)."""
    rows = read_jsonl(task_data_folder(cfg.data_dir, "squad_v2_dev") / "dev.jsonl")
    cfg.rng("squad").shuffle(rows)
    return [e for r in rows for e in squad_examples(r)]
