"""Optional loaders of the original datasets from the Hugging Face Hub (needs ``datasets`` and the network).

Never used by the tests or the bundled tasks; they convert with the same functions as the offline copies, so a user
with the network gets the full sets in the same format: ``--task hub:longbench/hotpotqa``, ``--task hub:squad_v2``,
``--task hub:musique``.

No loading script runs (current ``datasets``, 4.x, refuses them): SQuAD v2 and MuSiQue are plain data repositories
(``load_dataset(repo, split=...)``), and LongBench, a loading script on the Hub, is read from the Hub's parquet
conversion of it (the ``refs/convert/parquet`` revision, original field layout) with
``load_dataset("parquet", data_files=...)``. ``$KVFORGE_HUB_<SET>`` (``LONGBENCH``, ``SQUAD_V2``, ``MUSIQUE``) reads
a set from other parquet files instead (another mirror, or local files): a path, glob or URL, where ``{subset}`` is
the LongBench subset, e.g. ``KVFORGE_HUB_LONGBENCH=/data/longbench/{subset}.parquet``.
"""

from __future__ import annotations

import os
from typing import Any

from kvforge.errors import UserError
from kvforge.eval.data import Example
from kvforge.eval.tasks.base import Measure, TaskConfig
from kvforge.eval.tasks.longbench import PROMPTS, longbench_example
from kvforge.eval.tasks.musique import musique_example
from kvforge.eval.tasks.squad import squad_examples

# set -> ("parquet", files) or ("repo", repository, split); hf:// paths are read through huggingface_hub, a
# revision's "/" written %2F
SOURCES: dict[str, tuple[str, ...]] = {
    "longbench": ("parquet", "hf://datasets/THUDM/LongBench@refs%2Fconvert%2Fparquet/{subset}/test/*.parquet"),
    "squad_v2": ("repo", "rajpurkar/squad_v2", "validation"),
    "musique": ("repo", "dgslibisey/MuSiQue", "validation"),
}


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise UserError("hub tasks need the `datasets` package: pip install 'kvforge[hub]'") from e
    return datasets


def _rows(name: str, **fields: str) -> Any:
    """The rows of set ``name``: from ``$KVFORGE_HUB_<NAME>`` parquet files if set, else from its Hub source."""
    override = os.environ.get(f"KVFORGE_HUB_{name.upper()}")
    kind, *where = ("parquet", override) if override else SOURCES[name]
    try:
        if kind == "parquet":
            files = where[0].format(**fields)
            return _datasets().load_dataset("parquet", data_files=files, split="train")
        repo, split = where
        return _datasets().load_dataset(repo, split=split)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise UserError(f"cannot read hub set {name!r}: {str(e).splitlines()[0] if str(e) else repr(e)}") from e


def hub_task(cfg: TaskConfig, name: str) -> list[Example]:
    """Download and convert one ``hub:`` task (``name`` without the ``hub:`` prefix)."""
    if name.startswith("longbench/"):
        subset = name.split("/", 1)[1]
        if subset not in PROMPTS:
            raise UserError(f"unknown LongBench subset {subset!r}; choose from {', '.join(PROMPTS)}")
        rows = _rows("longbench", subset=subset)
        measure = Measure(cfg.tokenizer)
        return [longbench_example(dict(r, dataset=subset), measure, cfg.max_context_size) for r in rows]
    if name == "squad_v2":
        rows = _rows("squad_v2")
        return [
            e
            for r in rows
            for e in squad_examples({"context": r["context"], "qas": [{
                "id": r["id"], "question": r["question"], "answers": r["answers"]["text"],
                "is_impossible": not r["answers"]["text"]}]})
        ]  # fmt: skip
    if name == "musique":
        rows = _rows("musique")
        return [
            musique_example({"id": r["id"], "question": r["question"], "answers": [r["answer"], *r["answer_aliases"]],
                             "ctxs": [{"title": p["title"], "text": p["paragraph_text"]} for p in r["paragraphs"]]})
            for r in rows
        ]  # fmt: skip
    raise UserError(f"unknown hub task {name!r}; use hub:longbench/<subset>, hub:squad_v2 or hub:musique")
