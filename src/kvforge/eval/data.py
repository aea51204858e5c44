"""The evaluation data format: JSON Lines, one example per line, read and validated.

One line::

    {"id": str, "context": str, "question": str, "answers": [str, ...],
     "metric": "contains" | "contains_all" | "em" | "f1" | "rouge_l",
     "task": str?, "max_new_tokens": int?, "system": str?, "answer_prefix": str?, "chunks": [str, ...]?,
     "needles": [str, ...]?, "stored_question": str?}

``chunks`` (documents for RAG reuse) may replace ``context``: the context is then the chunks joined by a blank line.
``needles`` (optional, written by the needle tasks) are substrings of the context whose survival in the compressed
cache the fidelity metrics measure. ``stored_question`` (semantic-reuse rows) is asked and stored first, on the same
context; ``question`` is then answered with semantic reuse (``kvforge eval --semantic``). Unknown fields are ignored;
a malformed line raises :class:`DataFormatError` naming the file and the line number.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvforge.errors import UserError

METRIC_NAMES = ("contains", "contains_all", "em", "f1", "rouge_l")
CHUNK_SEPARATOR = "\n\n"


class DataFormatError(UserError):
    """A JSONL example file that does not follow the format (message names file and line)."""


@dataclass(frozen=True)
class Example:
    """One evaluation example: a context, a question, the reference answers and how to score a prediction."""

    id: str
    context: str
    question: str
    answers: list[str]
    metric: str = "contains"
    task: str = "custom"
    max_new_tokens: int = 64
    system: str | None = None
    answer_prefix: str = ""
    chunks: list[str] | None = None
    needles: list[str] = field(default_factory=list)
    stored_question: str | None = None

    def __post_init__(self) -> None:
        if self.metric not in METRIC_NAMES:
            raise ValueError(f"unknown metric {self.metric!r}; choose from {', '.join(METRIC_NAMES)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def to_json(self) -> dict[str, Any]:
        """The example as one JSONL object (optional fields only when set)."""
        row: dict[str, Any] = {"id": self.id, "task": self.task}
        if self.chunks is None:
            row["context"] = self.context
        else:
            row["chunks"] = list(self.chunks)
        row |= {"question": self.question, "answers": list(self.answers), "metric": self.metric}
        row["max_new_tokens"] = self.max_new_tokens
        if self.system is not None:
            row["system"] = self.system
        if self.answer_prefix:
            row["answer_prefix"] = self.answer_prefix
        if self.needles:
            row["needles"] = list(self.needles)
        if self.stored_question is not None:
            row["stored_question"] = self.stored_question
        return row


def _str_list(row: dict[str, Any], key: str, *, allow_empty: bool) -> list[str] | None:
    value = row.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key!r} must be a list of strings")
    if not value and not allow_empty:
        raise ValueError(f"{key!r} must not be empty")
    return value


def example_from_json(row: Any) -> Example:
    """Validate one decoded JSON object and build its :class:`Example` (raises ``ValueError`` on a bad field)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    for key in ("id", "question"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"missing or non-string field {key!r}")
    chunks = _str_list(row, "chunks", allow_empty=False)
    context = row.get("context")
    if context is None and chunks is None:
        raise ValueError("needs 'context' (a string) or 'chunks' (a list of strings)")
    if context is not None and not isinstance(context, str):
        raise ValueError("'context' must be a string")
    answers = _str_list(row, "answers", allow_empty=True)
    if answers is None:
        raise ValueError("missing field 'answers' (a list of strings)")
    metric = row.get("metric", "contains")
    if metric not in METRIC_NAMES:
        raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(METRIC_NAMES)}")
    max_new_tokens = row.get("max_new_tokens", 64)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"'max_new_tokens' must be a positive integer, got {max_new_tokens!r}")
    for key in ("task", "system", "answer_prefix", "stored_question"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise ValueError(f"{key!r} must be a string")
    return Example(
        id=row["id"],
        context=context if context is not None else CHUNK_SEPARATOR.join(chunks or []),
        question=row["question"],
        answers=answers,
        metric=metric,
        task=row.get("task") or "custom",
        max_new_tokens=max_new_tokens,
        system=row.get("system"),
        answer_prefix=row.get("answer_prefix") or "",
        chunks=chunks,
        needles=_str_list(row, "needles", allow_empty=True) or [],
        stored_question=row.get("stored_question"),
    )


def read_examples(path: str | Path, limit: int | None = None) -> list[Example]:
    """Read a JSONL example file; blank lines are skipped, duplicate ids and malformed lines are errors.

    Raises:
        DataFormatError: ``"<path>:<line>: <what is wrong>"`` for the first bad line, or an unreadable file.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataFormatError(f"cannot read {path}: {e}") from e
    examples: list[Example] = []
    seen: set[str] = set()
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            example = example_from_json(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{path}:{line_no}: invalid JSON ({e.msg} at column {e.colno})") from e
        except ValueError as e:
            raise DataFormatError(f"{path}:{line_no}: {e}") from e
        if example.id in seen:
            raise DataFormatError(f"{path}:{line_no}: duplicate id {example.id!r}")
        seen.add(example.id)
        examples.append(example)
        if limit is not None and len(examples) >= limit:
            break
    if not examples:
        raise DataFormatError(f"{path}: no examples")
    return examples


def write_examples(examples: Iterable[Example], path: str | Path) -> Path:
    """Write examples as JSONL (readable back by :func:`read_examples`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example.to_json(), ensure_ascii=False) + "\n")
    return path
