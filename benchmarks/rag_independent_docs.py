"""Multi-document needles whose documents are independent excerpts, not consecutive pieces of one text.

`needle-docs` cuts one haystack into consecutive documents, so a reused document misses real context from the one
before it. Here each of the 10 documents is its own excerpt from a random place in the haystack (`filler_text`), and
the needle goes into document ``floor(10 x depth)`` at the remaining depth. For each example: whether `full`,
`naive`, `ape`, `cacheblend` and `cacheclip` (at each ratio) answer it. One JSON line per example, then a summary.

    python benchmarks/rag_independent_docs.py --depths 0.1,0.3 --num-samples 3 --ratios 0.2,0.3
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter

import torch

from kvforge.engine import Engine
from kvforge.eval.tasks.base import Measure, TaskConfig
from kvforge.eval.tasks.needle import filler_text, insert_needles, load_haystack, needle_task
from kvforge.model import load_model
from kvforge.paths import default_data_dir
from kvforge.reuse.rag import ChunkReuse, make_strategy

NUM_DOCS = 10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data-dir", default=str(default_data_dir()))
    ap.add_argument("--length", type=int, default=4096, help="context tokens in all")
    ap.add_argument("--depths", default="0.1,0.3")
    ap.add_argument("--num-samples", type=int, default=3)
    ap.add_argument("--ratios", default="0.2,0.3", help="recompute ratios for cacheblend (first only) and cacheclip")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",")]
    model, tok = load_model(args.model)
    engine = Engine(model, tok)
    rag = ChunkReuse(model, tok, model_id=engine.model_id)
    depths = tuple(float(d) for d in args.depths.split(","))
    cfg = TaskConfig(args.data_dir, tokenizer=tok, lengths=(args.length,), depths=depths, num_samples=args.num_samples)
    haystack, measure = load_haystack(cfg), Measure(tok)
    runs = [("full", None), ("naive", None), ("ape", None), ("cacheblend", ratios[0])]
    runs += [("cacheclip", r) for r in ratios]
    totals: Counter[str] = Counter()
    examples = needle_task(cfg)  # the needles, questions and depths of the single-needle task
    for ex, depth in zip(examples, [d for d in depths for _ in range(args.num_samples)], strict=True):
        rng = random.Random(ex.id)
        docs = [filler_text(haystack, args.length // NUM_DOCS, measure, rng.random()).strip() for _ in range(NUM_DOCS)]
        j = min(NUM_DOCS - 1, int(depth * NUM_DOCS))
        docs[j], _ = insert_needles(docs[j], ex.needles, [depth * NUM_DOCS - j], measure)
        prompt = rag.build_prompt(docs, ex.question, answer_prefix=ex.answer_prefix)
        row: dict[str, object] = {"id": ex.id, "context_tokens": prompt.num_context_tokens}
        for name, ratio in runs:
            rag.method = make_strategy(name, ratio)
            gen = engine.answer_chunks(
                docs, ex.question, rag=rag, answer_prefix=ex.answer_prefix, max_new_tokens=args.max_new_tokens
            )
            text = gen.text
            key = name if ratio is None else f"{name}@{ratio:g}"
            row[key] = any(a in text for a in ex.answers)
            totals[key] += int(row[key])
        print(json.dumps(row), flush=True)
    print(json.dumps({"summary": {k: f"{v}/{len(examples)}" for k, v in totals.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
