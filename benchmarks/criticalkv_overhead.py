"""CriticalKV's selection cost before/after pruning the exact value norms, as a fraction of the prefill, one process.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/criticalkv_overhead.py --tokens 4096 --threads 1

One prefill of natural text on smollm2-135m (CompressionSource), then, alternating, the compression stage of SnapKV
alone, CriticalKV computing every token's ``||V W_O||_1`` (:func:`critical_select` with
:func:`projected_value_norms`, the earlier code) and CriticalKV with the pruned norms (the press as shipped).
Times are CPU seconds of this process (robust to other jobs on a shared machine); ``overhead`` = compression CPU time /
prefill CPU time. Also checks that both CriticalKV variants keep the same entries, and reports the fraction of
(token, KV head) norms the pruned one computed. JSON line to results/performance/criticalkv_overhead.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, append_rows
from decode import context_ids

from kvforge.cache import KVCache
from kvforge.model import load_model
from kvforge.presses import CompressionSource, build_press
from kvforge.presses import criticalkv as ck
from kvforge.presses.base import Selection
from kvforge.provenance import git_sha


def every_norm(self: ck.CriticalKVPress, ctx: Any) -> Selection:
    """CriticalKVPress.compress as it was: the exact norm of every token."""
    n = ck.num_kept(ctx.size, self.compression_ratio)
    scores = self.press.score(ctx)
    budgets = torch.full(scores.shape[:2], n, dtype=torch.long, device=scores.device)
    norms = ck.projected_value_norms(ctx)
    return Selection(keep=ck.critical_select(scores, norms, budgets, self.first_stage_ratio, self.epsilon))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ratio", type=float, default=0.75, help="fraction removed (0.75 = 25%% kept)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m")
    ids = context_ids(tokenizer, args.tokens)
    critical, snap = build_press("criticalkv", args.ratio), build_press("snapkv", args.ratio)
    cpu = time.process_time()
    source = CompressionSource(model, ids, KVCache.for_model(model), critical.needs(), tokenizer=tokenizer)
    prefill_cpu = time.process_time() - cpu
    shipped = ck.CriticalKVPress.compress
    computed = [0]
    l1 = ck._l1_norms

    def counting(values: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
        computed[0] += values.shape[0] * values.shape[1] * values.shape[2]
        return l1(values, w, group)

    variants = {
        "snapkv": (snap, shipped),
        "criticalkv_every_norm": (critical, every_norm),
        "criticalkv_pruned": (critical, shipped),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    kept: dict[str, list[torch.Tensor]] = {}
    ck._l1_norms = counting
    try:
        for _ in range(args.repeats):
            for name, (press, compress) in variants.items():
                ck.CriticalKVPress.compress = compress  # type: ignore[method-assign]
                source.restore()
                computed[0] = 0
                cpu = time.process_time()
                cache = source.compress(press)
                times[name].append(time.process_time() - cpu)
                kept[name] = [layer.view()[2].clone() for layer in cache.layers]
                if name == "criticalkv_pruned":
                    pruned_rows = computed[0]
    finally:
        ck.CriticalKVPress.compress = shipped  # type: ignore[method-assign]
        ck._l1_norms = l1
    med = {k: statistics.median(v) for k, v in times.items()}
    num_layers, h_kv = len(kept["snapkv"]), model.config.num_key_value_heads
    row = {
        "bench": "criticalkv_overhead",
        "tokens": args.tokens,
        "kept": round(1 - args.ratio, 3),
        "threads": torch.get_num_threads(),
        "prefill_cpu_s": round(prefill_cpu, 3),
        "compress_cpu_s": {k: round(v, 3) for k, v in med.items()},
        "overhead": {k: round(v / prefill_cpu, 4) for k, v in med.items()},
        "norms_computed_fraction": round(pruned_rows / (num_layers * h_kv * args.tokens), 3),
        "same_selection": all(
            torch.equal(a, b) for a, b in zip(kept["criticalkv_every_norm"], kept["criticalkv_pruned"], strict=True)
        ),
        "git": git_sha(),
    }
    print(json.dumps(row), flush=True)
    append_rows(RESULTS / "performance" / "criticalkv_overhead.jsonl", row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
