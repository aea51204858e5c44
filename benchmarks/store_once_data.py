"""Examples for the "store once, ask many" evaluation: a few documents with several questions each, as one JSONL.

    PYTHONPATH=src python benchmarks/store_once_data.py --out runs/store_once.jsonl
    kvforge eval --data runs/store_once.jsonl --store-once ...   (see README, "Store once, ask many")

Per source (a multi-needle document generated from the shipped haystack, SQuAD 2.0 dev paragraphs, L-Eval documents
cut to ``--max-context`` tokens), the first ``--docs`` documents with at least ``--questions`` questions, and their
first ``--questions`` questions; examples of one document share its context, so the stored trials store it once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvforge.eval.data import Example, write_examples
from kvforge.eval.tasks import TaskConfig, build_task
from kvforge.paths import default_data_dir


def pick(examples: list[Example], num_docs: int, num_questions: int) -> list[Example]:
    """The first ``num_questions`` questions of the first ``num_docs`` documents that have that many."""
    by_doc: dict[str, list[Example]] = {}
    for e in examples:
        by_doc.setdefault(e.context, []).append(e)
    docs = [qs[:num_questions] for qs in by_doc.values() if len(qs) >= num_questions][:num_docs]
    return [e for qs in docs for e in qs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer measures lengths")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--docs", type=int, default=2, help="documents per source")
    ap.add_argument("--questions", type=int, default=4, help="questions per document")
    ap.add_argument("--max-context", type=int, default=1536, help="needle length and L-Eval cut (tokens)")
    ap.add_argument("--tasks", default="needle-multi,squad,leval")
    args = ap.parse_args()
    from kvforge.model import load_model

    _, tokenizer = load_model(args.model)
    cfg = TaskConfig(data_dir=args.data_dir or default_data_dir(), tokenizer=tokenizer, lengths=(args.max_context,),
                     num_samples=args.docs, max_context_size=args.max_context)  # fmt: skip
    examples = []
    for task in args.tasks.split(","):
        chosen = pick(build_task(task, cfg), args.docs, args.questions)
        print(f"{task}: {len({e.context for e in chosen})} documents, {len(chosen)} questions", file=sys.stderr)
        examples += chosen
    write_examples(examples, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
