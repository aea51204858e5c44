"""MuSiQue with 10 retrieved passages (``data_dir/musique_rag``, CacheBlend's set): multi-document QA as ``chunks``."""

from __future__ import annotations

from typing import Any

from kvforge.eval.data import CHUNK_SEPARATOR, Example
from kvforge.eval.tasks.base import TaskConfig, read_jsonl
from kvforge.paths import task_data_folder

QUESTION = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nQuestion: {question}\nAnswer:"
)


def musique_example(row: dict[str, Any]) -> Example:
    """One question; each retrieved passage is one chunk ("Title: ...\\n" first when it has a title)."""
    chunks = [f"Title: {c['title']}\n{c['text']}" if c.get("title") else c["text"] for c in row["ctxs"]]
    return Example(
        id=str(row["id"]),
        context=CHUNK_SEPARATOR.join(chunks),
        question=QUESTION.format(question=row["question"]),
        answers=list(row["answers"]),
        metric="f1",
        task="musique",
        max_new_tokens=32,
        chunks=chunks,
    )


def musique_task(cfg: TaskConfig) -> list[Example]:
    """All shared questions in file order."""
    return [musique_example(r) for r in read_jsonl(task_data_folder(cfg.data_dir, "musique_rag") / "musique_s.jsonl")]
