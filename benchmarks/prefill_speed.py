"""Prefill speed: kvforge chunked (default 512) and one-shot vs a one-shot transformers sdpa forward, alternating runs.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/prefill_speed.py --tokens 2048 4096 --repeats 5 --threads 1

Every repeat runs the three in turn (transformers sdpa, kvforge chunked, kvforge one-shot) on the same token ids, so
load drifting on a shared machine hits all three alike; the ratios are median(transformers) / median(kvforge), i.e.
kvforge's speed as a fraction of transformers' (>= 0.95 is the issue-16 bar for the chunked prefill); the
``*_cpu_time`` ratios use this process's CPU seconds, which other jobs on a shared machine do not inflate (with one
thread they measure the work done; wall-clock ratios swing with the load). The transformers
forward keeps its KV (``use_cache=True``, a DynamicCache) and computes only the last logits, as kvforge does.
One JSON line per length, printed and appended to results/performance/prefill_speed.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, append_rows

from kvforge.cache import KVCache
from kvforge.model import load_model
from kvforge.prefill import DEFAULT_CHUNK_SIZE, prefill
from kvforge.provenance import git_sha


@torch.inference_mode()
def hf_sdpa_forward(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own one-shot forward on sdpa (the model's implementation is switched back after)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[:, -1]
    finally:
        model.set_attn_implementation(previous)


def kvforge_prefill(model: Any, ids: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
    return prefill(model, ids, KVCache.for_model(model), chunk_size=chunk_size)


def timed(fn: Any) -> tuple[float, float, Any]:
    """Wall seconds, CPU seconds of this process (robust to other jobs on a shared machine), result."""
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - start, time.process_time() - cpu, out


def measure(model: Any, n: int, repeats: int, chunk_size: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, n), generator=gen).to(model.device)
    runs: dict[str, Any] = {
        "transformers_sdpa": lambda: hf_sdpa_forward(model, ids),
        "kvforge_chunked": lambda: kvforge_prefill(model, ids, chunk_size),
        "kvforge_one_shot": lambda: kvforge_prefill(model, ids, None),
    }
    for fn in runs.values():  # warm-up (allocator, first-call initialisation)
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu_times: dict[str, list[float]] = {name: [] for name in runs}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        for name, fn in runs.items():
            secs, cpu, outs[name] = timed(fn)
            times[name].append(secs)
            cpu_times[name].append(cpu)
    med = {name: statistics.median(t) for name, t in times.items()}
    cpu_med = {name: statistics.median(t) for name, t in cpu_times.items()}
    ref = outs["transformers_sdpa"].float()
    return {
        "tokens": n,
        "chunk_size": chunk_size,
        "repeats": repeats,
        "seconds_median": {k: round(v, 4) for k, v in med.items()},
        "cpu_seconds_median": {k: round(v, 4) for k, v in cpu_med.items()},
        "chunked_vs_sdpa": round(med["transformers_sdpa"] / med["kvforge_chunked"], 3),
        "one_shot_vs_sdpa": round(med["transformers_sdpa"] / med["kvforge_one_shot"], 3),
        "chunked_vs_sdpa_cpu_time": round(cpu_med["transformers_sdpa"] / cpu_med["kvforge_chunked"], 3),
        "one_shot_vs_sdpa_cpu_time": round(cpu_med["transformers_sdpa"] / cpu_med["kvforge_one_shot"], 3),
        "max_abs_logit_diff_chunked": float((outs["kvforge_chunked"].float() - ref).abs().max()),
        "max_abs_logit_diff_one_shot": float((outs["kvforge_one_shot"].float() - ref).abs().max()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "performance" / "prefill_speed.jsonl"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, device=args.device)
    sha = git_sha()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for n in args.tokens:
        row = {
            "bench": "prefill_speed",
            "model": args.model,
            "device": str(model.device),
            "dtype": str(next(model.parameters()).dtype),
            "threads": torch.get_num_threads(),
            "git": sha,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **measure(model, n, args.repeats, args.chunk_size, args.seed),
        }
        print(json.dumps(row), flush=True)
        append_rows(args.out, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
