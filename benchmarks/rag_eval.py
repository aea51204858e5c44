"""RAG chunk reuse: quality normalised to full prefill and TTFT speedup (chunks already stored).

One JSON line per example x configuration to ``--out``/rows.jsonl, the summary (one row per method and recompute
ratio) to ``--out``/summary.json and a table on stdout.

    python benchmarks/rag_eval.py --model smollm2-135m --dataset musique --limit 8 --aux gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvforge.paths import default_data_dir
from kvforge.rag import RagModel
from kvforge.rag.evaluate import RagConfig, evaluate, load_musique, make_needle_examples, summarize


def load(name: str):
    from transformers.utils import logging as hf_logging

    from kvforge.model import load_model

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return load_model(name)


def configs(strategies: list[str], ratios: list[float], aux_names: list[str]) -> list[RagConfig]:
    out = []
    for s in strategies:
        if s in ("cacheblend", "cacheclip"):
            for r in ratios:
                out.append(RagConfig(s, r))
                if s == "cacheclip":
                    out += [RagConfig(s, r, aux_name=a) for a in aux_names]
        else:
            out.append(RagConfig(s))
    return out


def print_table(summary: list[dict]) -> None:
    print("| method | r | quality vs full | score | TTFT s (median) | speedup vs full | recomputed | tokens | n |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        q = "-" if s["quality_vs_full"] is None else f"{100 * s['quality_vs_full']:.0f}%"
        sp = "-" if s["speedup_vs_full"] is None else f"{s['speedup_vs_full']:.2f}x"
        r = "-" if s["recompute_ratio"] is None else s["recompute_ratio"]
        print(f"| {s['method']} | {r} | {q} | {s['score']:.3f} | {s['ttft_s']:.1f} | {sp} | "
              f"{100 * s['recomputed_share']:.0f}% | {s['mean_tokens']:.0f} | {s['num_examples']} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--aux", default="", help="comma-separated extra CacheClip auxiliary models (self always runs)")
    ap.add_argument("--dataset", choices=["musique", "needle"], default="musique")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--needle-docs", type=int, default=10)
    ap.add_argument("--needle-doc-chars", type=int, default=2000)
    ap.add_argument("--strategies", default="naive,ape,cacheblend,cacheclip")
    ap.add_argument("--recompute-ratios", default="0.2")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/rag"))
    ap.add_argument("--report", type=Path, default=None, help="only print the table of an existing rows file")
    args = ap.parse_args()
    if args.report is not None:
        rows = [json.loads(line) for line in args.report.read_text().splitlines() if line.strip()]
        print_table(summarize(rows))
        return 0
    torch.set_num_threads(args.threads)
    data = args.data_dir or default_data_dir()
    if args.dataset == "musique":
        examples = load_musique(data / "musique_rag" / "musique_s.jsonl", args.limit)
    else:
        examples = make_needle_examples(data / "haystack_paul_graham" / "essays.jsonl", args.limit,
                                        args.needle_docs, args.needle_doc_chars)
    model, tok = load(args.model)
    rag = RagModel(model, tok)
    aux_names = [a for a in args.aux.split(",") if a]
    aux_models = {a: RagModel(*load(a)) for a in aux_names}
    ratios = [float(r) for r in args.recompute_ratios.split(",")]
    cfgs = configs(args.strategies.split(","), ratios, aux_names)
    args.out.mkdir(parents=True, exist_ok=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"model": args.model, "dataset": args.dataset, "limit": args.limit, "git": sha,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads}
    rows = []
    with open(args.out / f"rows_{args.dataset}.jsonl", "w") as f:
        for row in evaluate(rag, examples, cfgs, aux_models, args.max_new_tokens):
            row |= meta
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps({k: row[k] for k in ("id", "method", "recompute_ratio", "score", "ttft_s",
                                                   "num_tokens", "prediction")}), file=sys.stderr)
    summary = [s | meta for s in summarize(rows)]
    (args.out / f"summary_{args.dataset}.json").write_text(json.dumps(summary, indent=1))
    print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
