"""LongBench v1 (``data_dir/longbench``) and L-Eval (``data_dir/leval_multiquestion``) converted to examples.

LongBench rows keep LongBench's own prompt templates (``dataset2prompt``), split at ``{context}``: the text before
and the document form the context, the rest (question and instruction) the question; metrics and answer lengths are
LongBench's (token F1 for QA, ROUGE-L for summaries; ``dataset2maxlen``). L-Eval gives one example per question
of each document (token F1; ROUGE-L for ``gov_report_summ``). Contexts longer than ``max_context_size`` lose their
middle, as in LongBench's ``pred.py``.
"""

from __future__ import annotations

from typing import Any

from kvforge.eval.data import Example
from kvforge.eval.tasks.base import Measure, TaskConfig, interleave, read_jsonl, truncate_middle
from kvforge.paths import task_data_folder

_MULTIDOC = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only "
    "give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
PROMPTS = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
        "{context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
        'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or '
        '"unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the '
        "above article as concisely as you can, using a single phrase or sentence if possible. If the question "
        'cannot be answered based on the information in the article, write "unanswerable". If the question is a '
        'yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: '
        "{input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the "
        "above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "hotpotqa": _MULTIDOC,
    "2wikimqa": _MULTIDOC,
    "musique": _MULTIDOC,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "multi_news": (
        "You are given several news articles. Write a one-page summary of all news.\n\nNews:\n{context}\n\nNow, "
        "write a one-page summary of all the news.\n\nSummary:"
    ),
}
MAX_NEW_TOKENS = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32,
                  "musique": 32, "gov_report": 512, "multi_news": 512}  # fmt: skip
QA_SETS = ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "narrativeqa")
SUMM_SETS = ("gov_report", "multi_news")


def longbench_example(row: dict[str, Any], measure: Measure, max_context_size: int | None = None) -> Example:
    """One LongBench row (original field layout) as an example with LongBench's prompt, metric and length."""
    dataset = row["dataset"]
    if dataset not in PROMPTS:
        raise ValueError(f"no LongBench prompt for dataset {dataset!r}")
    head, tail = PROMPTS[dataset].split("{context}")
    is_summary = dataset in SUMM_SETS
    return Example(
        id=str(row["_id"]),
        context=head + truncate_middle(row["context"], max_context_size, measure),
        question=tail.lstrip("\n").replace("{input}", row.get("input") or ""),
        answers=list(row["answers"]),
        metric="rouge_l" if is_summary else "f1",
        task="longbench-summ" if is_summary else "longbench-qa",
        max_new_tokens=MAX_NEW_TOKENS[dataset],
    )


def longbench_task(cfg: TaskConfig, datasets: tuple[str, ...] = QA_SETS) -> list[Example]:
    """Every shared LongBench row of ``datasets``, interleaved across datasets."""
    measure = Measure(cfg.tokenizer)
    folder = task_data_folder(cfg.data_dir, "longbench")
    rows = [read_jsonl(folder / f"{d}.jsonl") for d in datasets]
    return interleave([[longbench_example(r, measure, cfg.max_context_size) for r in group] for group in rows])


def leval_examples(row: dict[str, Any], measure: Measure, max_context_size: int | None = None) -> list[Example]:
    """One L-Eval document with its questions as one example per question (same context for all)."""
    is_summary = row["task"].endswith("_summ")
    context = truncate_middle(row["input"], max_context_size, measure)
    return [
        Example(
            id=f"{row['id']}-q{i}",
            context=context,
            question=question.strip() + "\nAnswer briefly.",
            answers=[answer.strip()],
            metric="rouge_l" if is_summary else "f1",
            task=f"leval-{row['task']}",
            max_new_tokens=256 if is_summary else 64,
        )
        for i, (question, answer) in enumerate(zip(row["instructions"], row["outputs"], strict=False))
    ]


def leval_task(cfg: TaskConfig) -> list[Example]:
    """Every shared L-Eval question, interleaved across the task files."""
    measure = Measure(cfg.tokenizer)
    files = sorted(task_data_folder(cfg.data_dir, "leval_multiquestion").glob("*.jsonl"))
    return interleave(
        [[e for r in read_jsonl(f) for e in leval_examples(r, measure, cfg.max_context_size)] for f in files]
    )
