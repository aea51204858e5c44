"""Bounded memory while generating: answers of 1,024 tokens with a fixed KV budget vs the full cache.

    PYTHONPATH=src python benchmarks/decoding_budget.py --examples 3 --prompt-tokens 2048 --new-tokens 1024 \
        --budget 1024 --data-dir DATA_DIR --out results/presses/decoding_budget.jsonl

Task: LongBench gov_report (reports of the U.S. Government Accountability Office with reference summaries of 500 to
1,300 tokens; shared data), prompts cut to ``--prompt-tokens`` (LongBench's middle cut), LongBench's prompt, greedy,
EOS ignored so every answer is ``--new-tokens`` long. Per example and method, one JSON line:

- ``rouge_l``: ROUGE-L F of the answer against the reference summary; ``rouge_l_vs_full``: against the full cache's
  answer (how much of the full-cache answer the method reproduces);
- ``kl``, ``top1``: mean KL(full || method) of the next-token distributions and how often their arg-max agree, along
  the full cache's own answer teacher-forced through both caches in lockstep (the method's cache keeps applying its
  budget on those forwards), per 256-token quarter too (``kl_by_quarter``);
- ``max_entries``: entries the fullest layer's KV head held at the end of the answer; ``lockstep_max_entries``: the
  most it held after any forward of the teacher-forced pass (the peak); ``final_bytes``: cache bytes at the end;
  ``decode_tok_s``: generation speed; ``answer``: the whole answer (``--no-full`` in one process and the full cache
  alone in another compare their answers afterwards).

Methods: ``full`` (no bound), ``decoding`` (kvforge's DecodingPress: attention-scored cut every ``--interval``
steps to ``--budget``), ``window`` (a StreamingLLM sliding window of ``--budget`` entries with 4 sinks).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvforge.cache import KVCache
from kvforge.decode import decode
from kvforge.engine import Engine
from kvforge.eval.metrics import score_prediction
from kvforge.eval.tasks import TaskConfig, build_task
from kvforge.model import load_model
from kvforge.paths import default_data_dir
from kvforge.prefill import forward, prefill
from kvforge.presses import DecodingPress


def new_cache(model: Any, method: str, args: argparse.Namespace) -> KVCache:
    if method == "window":
        return KVCache.for_model(model, window=args.budget, num_sink=4)
    cache = KVCache.for_model(model)
    if method == "decoding":
        DecodingPress(budget=args.budget, interval=args.interval).attach(cache)
    return cache


def held(cache: KVCache) -> int:
    return max(
        int(layer.valid[:, :, : layer.length].sum(-1).max()) if layer.valid is not None else layer.length
        for layer in cache.layers
    )


@torch.inference_mode()
def run_example(model: Any, tok: Any, ids: list[int], ref: str, args: argparse.Namespace, emit: Any) -> None:
    """One row per method, handed to ``emit`` as soon as it is measured."""
    answers: dict[str, str] = {}
    full_answer: list[int] = []
    for method in ([] if args.no_full else ["full"]) + args.methods:
        cache = new_cache(model, method, args)
        logits = prefill(model, torch.tensor([ids]), cache, chunk_size=args.chunk_size)
        start = time.perf_counter()
        out = decode(model, cache, logits, args.new_tokens)
        seconds = time.perf_counter() - start
        text = tok.decode(out.token_ids, skip_special_tokens=True)
        answers[method] = text
        if method == "full":
            full_answer = list(out.token_ids)
        row = {"method": method, "budget": None if method == "full" else args.budget, "prompt_tokens": len(ids),
               "new_tokens": len(out.token_ids), "rouge_l": score_prediction(text, [ref], "rouge_l"),
               "rouge_l_vs_full": score_prediction(text, [answers["full"]], "rouge_l") if "full" in answers else None,
               "max_entries": held(cache), "final_bytes": cache.nbytes(), "decode_tok_s": len(out.token_ids) / seconds,
               "answer": text}  # fmt: skip
        if method != "full" and full_answer and not args.no_lockstep:
            row |= lockstep(model, ids, full_answer, method, args)
        emit(row)
        print(json.dumps({k: v for k, v in row.items() if k != "answer"}), file=sys.stderr, flush=True)


def lockstep(model: Any, ids: list[int], answer: list[int], method: str, args: argparse.Namespace) -> dict[str, Any]:
    """The full cache's answer teacher-forced through the full cache and the method's cache, one token at a time."""
    caches = [new_cache(model, "full", args), new_cache(model, method, args)]
    last = [prefill(model, torch.tensor([ids]), c, chunk_size=args.chunk_size) for c in caches]
    kls, agree, peak = [], [], 0
    for token in answer:
        lp = [torch.log_softmax(x.float(), dim=-1) for x in last]
        kls.append(float((lp[0].exp() * (lp[0] - lp[1])).sum().clamp_min(0)))
        agree.append(float(lp[0].argmax() == lp[1].argmax()))
        last = [forward(model, torch.tensor([[token]]), c)[:, -1] for c in caches]
        peak = max(peak, held(caches[1]))
    q = max(1, len(kls) // 4)
    return {"kl": sum(kls) / len(kls), "top1": sum(agree) / len(agree),
            "kl_by_quarter": [round(sum(kls[i:i + q]) / len(kls[i:i + q]), 4) for i in range(0, len(kls), q)][:4],
            "lockstep_max_entries": peak}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--interval", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=64, help="prefill chunk (one step's worth while prefilling)")
    p.add_argument("--methods", nargs="*", default=["decoding", "window"])
    p.add_argument("--no-full", action="store_true", help="skip the full-cache run (run it in another process)")
    p.add_argument("--no-lockstep", action="store_true", help="skip the teacher-forced KL/top-1 comparison")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data-dir", type=Path, default=None, help="evaluation data folder (default: as kvforge eval)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m", device="cpu")
    engine = Engine(model, tok)
    cfg = TaskConfig(args.data_dir or default_data_dir(), tokenizer=tok, max_context_size=args.prompt_tokens)
    examples = [e for e in build_task("longbench-summ", cfg) if "gov_report" in e.id][: args.examples]
    done = set()
    if args.out.exists():
        done = {(r["id"], r["method"]) for r in map(json.loads, filter(str.strip, args.out.read_text().splitlines()))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    methods = ([] if args.no_full else ["full"]) + args.methods
    for ex in examples:
        if all((ex.id, m) in done for m in methods):
            continue
        ctx, question = engine.encode_qa(ex.context, ex.question, system=ex.system, answer_prefix=ex.answer_prefix)

        def emit(row: dict[str, Any], example_id: str = ex.id) -> None:
            with args.out.open("a") as f:
                f.write(json.dumps({"id": example_id, **row, "interval": args.interval}) + "\n")

        run_example(model, tok, ctx + question, ex.answers[0], args, emit)


if __name__ == "__main__":
    main()
