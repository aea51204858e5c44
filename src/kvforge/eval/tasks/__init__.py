"""Built-in tasks: ``TASKS[name](config) -> list[Example]``, generated from a seed or converted from the shared data.

``build_task("needle", TaskConfig(data_dir, tokenizer=tok))``; ``hub:...`` names load the original datasets
(:mod:`kvforge.eval.tasks.hub`, network needed).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvforge.eval.data import Example
from kvforge.eval.tasks.base import Measure, TaskConfig
from kvforge.eval.tasks.longbench import QA_SETS, SUMM_SETS, leval_task, longbench_task
from kvforge.eval.tasks.musique import musique_task
from kvforge.eval.tasks.needle import (
    multi_needle_task,
    narrative_multi_task,
    narrative_needle_task,
    needle_docs_task,
    needle_task,
)
from kvforge.eval.tasks.ruler import common_words_task, ruler_mix, variable_tracking_task
from kvforge.eval.tasks.semantic import semantic_long_task, semantic_task
from kvforge.eval.tasks.squad import squad_task
from kvforge.names import check_task
from kvforge.paths import task_data_folder

TASKS: dict[str, Callable[[TaskConfig], list[Example]]] = {
    "needle": needle_task,
    "needle-docs": needle_docs_task,
    "needle-multi": multi_needle_task,
    "needle-narrative": narrative_needle_task,
    "needle-narrative-docs": partial(needle_docs_task, narrative=True),
    "needle-multi-narrative": narrative_multi_task,
    "ruler-mk": partial(needle_task, variant="mk"),
    "ruler-mv": partial(needle_task, variant="mv"),
    "ruler-mq": partial(needle_task, variant="mq"),
    "ruler-vt": variable_tracking_task,
    "ruler-cwe": common_words_task,
    "ruler": ruler_mix,
    "longbench-qa": longbench_task,
    "longbench-summ": partial(longbench_task, datasets=SUMM_SETS),
    "longbench": partial(longbench_task, datasets=QA_SETS + SUMM_SETS),
    "leval": leval_task,
    "squad": squad_task,
    "musique": musique_task,
    "semantic": semantic_task,
    "semantic-long": semantic_long_task,
}


# The shared-data folder each converted task reads (generated tasks need only a haystack, which ships with kvforge).
TASK_DATA: dict[str, str] = {
    "longbench-qa": "longbench",
    "longbench-summ": "longbench",
    "longbench": "longbench",
    "leval": "leval_multiquestion",
    "squad": "squad_v2_dev",
    "musique": "musique_rag",
    "semantic": "squad_paraphrase",
    "semantic-long": "squad_paraphrase",
}


def check_task_data(names: list[str], data_dir: Path) -> None:
    """Check task names before any model loads; a converted task whose data folder is missing says once here (not
    after the model load) that it runs on the bundled sample (:func:`kvforge.paths.task_data_folder`)."""
    for name in names:
        check_task(name)  # the names live in kvforge.names (checkable without torch)
        folder = TASK_DATA.get(name)
        if folder is not None:
            task_data_folder(Path(data_dir), folder)


def build_task(name: str, config: TaskConfig) -> list[Example]:
    """The examples of task ``name`` (a key of :data:`TASKS`, or ``hub:...``)."""
    if check_task(name).startswith("hub:"):
        from kvforge.eval.tasks.hub import hub_task

        return hub_task(config, name[4:])
    return TASKS[name](config)


__all__ = ["TASKS", "TASK_DATA", "Measure", "TaskConfig", "build_task", "check_task_data"]
