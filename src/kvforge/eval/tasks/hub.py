"""Optional loaders of the original datasets from the Hugging Face Hub (needs ``datasets`` and the network).

Never used by the tests or the bundled tasks; they convert with the same functions as the offline copies, so a user
with the network gets the full sets in the same format: ``--task hub:longbench/hotpotqa``, ``--task hub:squad_v2``,
``--task hub:musique``.
"""

from __future__ import annotations

from typing import Any

from kvforge.errors import UserError
from kvforge.eval.data import Example
from kvforge.eval.tasks.base import Measure, TaskConfig
from kvforge.eval.tasks.longbench import PROMPTS, longbench_example
from kvforge.eval.tasks.musique import musique_example
from kvforge.eval.tasks.squad import squad_examples


def _load(*args: Any, **kwargs: Any) -> Any:
    try:
        import datasets
    except ImportError as e:
        raise UserError("hub tasks need the `datasets` package: pip install 'kvforge[hub]'") from e
    return datasets.load_dataset(*args, **kwargs)


def hub_task(cfg: TaskConfig, name: str) -> list[Example]:
    """Download and convert one ``hub:`` task (``name`` without the ``hub:`` prefix)."""
    if name.startswith("longbench/"):
        subset = name.split("/", 1)[1]
        if subset not in PROMPTS:
            raise UserError(f"unknown LongBench subset {subset!r}; choose from {', '.join(PROMPTS)}")
        rows = _load("THUDM/LongBench", subset, split="test", trust_remote_code=True)
        measure = Measure(cfg.tokenizer)
        return [longbench_example(dict(r, dataset=subset), measure, cfg.max_context_size) for r in rows]
    if name == "squad_v2":
        rows = _load("rajpurkar/squad_v2", split="validation")
        return [
            e
            for r in rows
            for e in squad_examples({"context": r["context"], "qas": [{
                "id": r["id"], "question": r["question"], "answers": r["answers"]["text"],
                "is_impossible": not r["answers"]["text"]}]})
        ]  # fmt: skip
    if name == "musique":
        rows = _load("dgslibisey/MuSiQue", split="validation")
        return [
            musique_example({"id": r["id"], "question": r["question"], "answers": [r["answer"], *r["answer_aliases"]],
                             "ctxs": [{"title": p["title"], "text": p["paragraph_text"]} for p in r["paragraphs"]]})
            for r in rows
        ]  # fmt: skip
    raise UserError(f"unknown hub task {name!r}; use hub:longbench/<subset>, hub:squad_v2 or hub:musique")
