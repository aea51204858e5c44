"""TTFT of RAG chunk reuse against the full prefill of the same prompt, alternating within one run.

One `needle-docs` prompt (``--length`` tokens of context in 10 documents, chunks stored before the clock starts).
Each round runs the full prefill, then every method once, so each method's time sits next to a full prefill's;
the speed-up is the median over rounds of (full prefill of the round / method). Each method also reports where its
time goes: ``plan_s`` (load, re-rotation, selection, cache build) and ``run_s`` (the recomputed tokens, separators
and question through the model), and its recompute share. One JSON line per method on stdout.

    python benchmarks/rag_speed.py --length 4096 --rounds 3 --methods naive,ape,epic:16,epic:0.2,cacheblend:0.2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from kvforge.engine import Engine
from kvforge.eval.tasks.base import TaskConfig
from kvforge.eval.tasks.needle import needle_docs_task
from kvforge.model import load_model
from kvforge.paths import default_data_dir
from kvforge.request import Chunks, Request
from kvforge.reuse.rag import ChunkReuse, make_strategy


def strategy(spec: str) -> Any:
    """``name`` or ``name:ratio`` (``epic:16``: 16 tokens per chunk, an integer)."""
    name, _, arg = spec.partition(":")
    if not arg:
        return make_strategy(name)
    if name.startswith("epic") and arg.isdigit():
        return make_strategy(name, recompute_tokens=int(arg))
    return make_strategy(name, float(arg))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--depth", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default="naive,ape,epic:16,epic:0.2,cacheblend:0.2,cacheclip:0.2")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    engine = Engine(model, tok)
    cfg = TaskConfig(str(default_data_dir()), tokenizer=tok, lengths=(args.length,), depths=(args.depth,))
    ex = needle_docs_task(cfg)[0]
    specs = ["full", *args.methods.split(",")]
    rags = {s: ChunkReuse(model, tok, model_id=engine.model_id, method=strategy(s)) for s in specs}

    def request(rag: ChunkReuse) -> Request:
        chunks = Chunks(list(ex.chunks), ex.question, ex.system, answer_prefix=ex.answer_prefix)
        return Request(chunks, max_new_tokens=0, reuse=rag)

    for rag in rags.values():  # chunks stored (and every code path warmed up once) before any clock
        rag.warm(engine.encode(request(rag)).context)
        engine.complete(engine.add(request(rag)))
    times: dict[str, list[dict[str, float]]] = {s: [] for s in specs}
    for _ in range(args.rounds):
        for spec in specs:
            start = time.perf_counter()
            seq = engine.add(request(rags[spec]))
            planned = time.perf_counter()
            engine.complete(seq)
            int(seq.logits.argmax(-1))  # the first token is picked: TTFT ends here
            end = time.perf_counter()
            info = seq.plan.summary()
            times[spec].append({"ttft_s": end - start, "plan_s": planned - start, "run_s": end - planned,
                                "recomputed": info.get("recomputed_tokens", 0), "tokens": len(seq.plan.token_ids)})
    full = [t["ttft_s"] for t in times["full"]]
    context = sum(len(tok(c, add_special_tokens=False)["input_ids"]) for c in ex.chunks)
    for spec in specs:
        rows = times[spec]
        print(json.dumps({
            "method": spec, "prompt_tokens": rows[0]["tokens"], "context_tokens": context,
            "recompute_share": round(rows[0]["recomputed"] / context, 4),
            "speedup_median": round(statistics.median(f / r["ttft_s"] for f, r in zip(full, rows, strict=True)), 2),
            "ttft_s_median": round(statistics.median(r["ttft_s"] for r in rows), 3),
            "plan_s_median": round(statistics.median(r["plan_s"] for r in rows), 3),
            "run_s_median": round(statistics.median(r["run_s"] for r in rows), 3),
            "rounds": args.rounds, "threads": args.threads,
        }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
