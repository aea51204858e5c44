"""Semantic-reuse tasks (the semantic-reuse paper's experiment): a question is stored, then another one is asked.

Every example carries ``stored_question`` (asked and stored first, on the same context) and ``question`` (asked
next, answered with semantic reuse under ``kvforge eval --semantic``). From ``squad_paraphrase`` (evaluation side
only: :mod:`kvforge.eval.semantic_pairs`):

* ``semantic-squad``: the paraphrase of the stored question (should reuse; SQuAD's lightly edited paraphrases),
* ``semantic-squad-adv``: fluent rewordings (should reuse; the set's "adversarial" paraphrases),
* ``semantic-squad-neg``: another question about the same paragraph (must not reuse: its answer differs).

``semantic-long``: the paraphrase pairs with the paragraph placed at the end of haystack text, so that the prompt has
each of ``--lengths`` tokens (the TTFT-by-prompt-length figure, up to the model's context).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.eval.data import Example
from kvforge.eval.semantic_pairs import side_of
from kvforge.eval.tasks.base import Measure, TaskConfig, interleave, read_jsonl
from kvforge.paths import bundled_data_dir, haystack_files, task_data_folder

SYSTEM = "Answer the question with a short phrase copied from the text."
MAX_NEW_TOKENS = 16


def _rows(cfg: TaskConfig) -> list[dict[str, Any]]:
    """The evaluation side of ``squad_paraphrase`` (all of the bundled sample, which has no sides)."""
    folder = task_data_folder(cfg.data_dir, "squad_paraphrase")
    rows = read_jsonl(folder / "pairs.jsonl")
    if Path(folder).resolve() != (bundled_data_dir() / "squad_paraphrase").resolve():
        rows = [r for r in rows if side_of(r["context"]) == "evaluation"]
    cfg.rng("semantic").shuffle(rows)
    return rows


def _example(row: dict[str, Any], kind: str, asked: str, answers: list[str], context: str | None = None,
             suffix: str = "") -> Example:  # fmt: skip
    return Example(
        id=f"{kind}-{row['id']}{suffix}",
        context=row["context"] if context is None else context,
        question=asked,
        answers=list(answers),
        metric="f1",
        task=kind,
        max_new_tokens=MAX_NEW_TOKENS,
        system=SYSTEM,
        stored_question=row["question"],
    )


def semantic_task(cfg: TaskConfig) -> list[Example]:
    """Paraphrases (light and fluent) and same-paragraph negatives of the stored questions, interleaved."""
    rows = _rows(cfg)
    gold = {r["question"].strip().lower(): r["answers"] for r in rows}
    para = [_example(r, "semantic-squad", r["paraphrase"], r["answers"]) for r in rows if r["kind"] != "adversarial"]
    adv = [_example(r, "semantic-squad-adv", r["paraphrase"], r["answers"]) for r in rows if r["kind"] == "adversarial"]
    neg = []
    for r in rows:
        others = [q for q in r.get("negatives_same_context", []) if q.strip().lower() in gold
                  and q.strip().lower() != r["question"].strip().lower()]  # fmt: skip
        if others:
            neg.append(_example(r, "semantic-squad-neg", others[0], gold[others[0].strip().lower()]))
    return interleave([para, adv, neg])


def semantic_long_task(cfg: TaskConfig) -> list[Example]:
    """``num_samples`` paraphrase pairs per length of ``cfg.lengths``: haystack text, then the paragraph (pairs whose
    paragraph alone is longer than the length are passed over)."""
    measure = Measure(cfg.tokenizer)
    rows = [r for r in _rows(cfg) if r["kind"] != "adversarial"]
    filler = "\n\n".join(_read_text(p) for p in haystack_files(cfg.data_dir)[:2])
    out = []
    for length in cfg.lengths:
        taken = 0
        for r in rows:  # the first num_samples pairs whose paragraph fits the length
            room = length - measure.size(r["context"]) - measure.size(r["paraphrase"]) - 64  # template, system
            if room <= 0 or taken == cfg.num_samples:
                continue
            taken += 1
            start = cfg.rng("semantic-long", length, r["id"]).randrange(max(1, len(filler) // 2))
            context = measure.head(filler[start:], room) + "\n\n" + r["context"]
            out.append(_example(r, f"semantic-long-{length}", r["paraphrase"], r["answers"], context, f"-{length}"))
    return out


def _read_text(path: Path) -> str:
    import json

    if path.suffix == ".jsonl":
        lines = path.read_text(encoding="utf-8").splitlines()
        return "\n\n".join(json.loads(line).get("text", "") for line in lines if line.strip())
    return path.read_text(encoding="utf-8")
