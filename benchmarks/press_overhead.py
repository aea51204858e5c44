"""Compression overhead vs plain prefill, cache bytes kept, and decode speed compressed vs full.

    PYTHONPATH=src python benchmarks/press_overhead.py --tokens 2048 4096 8192 --presses snapkv adakv --ratio 0.75

Plain prefills and the presses' runs alternate (repeat r runs the plain prefill, then every press), so load drifting
on a shared machine hits them alike. One JSON line per (tokens, press): prefill_s (plain prefill, median), press_s
(whole compress_prefill, median), replay_vs_prefill (KVzip's replay stage / the prefill stage of the same call),
stages (compress_prefill's own per-stage clock: prefill / lookahead / reconstruction / compress), overhead =
(lookahead + reconstruction + compress) / prefill stage of the same run (robust to load drifting between runs on a
shared machine), e2e_overhead = press_s / prefill_s - 1, cpu_overhead = the same with process CPU seconds (with
--threads 1 the least disturbed by other jobs: replay cost = cpu_overhead for KVzip), cache_bytes (kept) vs
full_bytes, decode tokens/s with the compressed and the full cache.
Model: smollm2-135m (bundled); tokens are natural text (Moby-Dick) so attention is realistic.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import append_rows
from press_needle import load_smollm2

from kvforge.cache import KVCache
from kvforge.paths import default_data_dir
from kvforge.prefill import forward, prefill
from kvforge.presses import build_press, compress_prefill
from kvforge.provenance import git_sha


def text_ids(tokenizer: Any, n: int) -> torch.Tensor:
    text = json.loads((default_data_dir() / "haystack_gutenberg" / "books.jsonl").open().readline())["text"]
    return torch.tensor([tokenizer.encode(text[: n * 8], add_special_tokens=False)[:n]])


@torch.inference_mode()
def decode_speed(model: Any, cache: KVCache, logits: torch.Tensor, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = forward(model, logits.argmax(-1, keepdim=True), cache)[:, -1]
    return steps / (time.perf_counter() - t0)


CPU_SECONDS: list[float] = []  # process CPU time of every timed() call, in order


def timed(fn: Any) -> tuple[float, Any]:
    """Wall clock of ``fn()``; its process CPU time goes to CPU_SECONDS (with 1 thread, CPU time is what other jobs
    on a shared machine disturb least)."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    CPU_SECONDS.append(time.process_time() - c0)
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument(
        "--presses",
        nargs="+",
        default=[
            "streaming_llm",
            "snapkv",
            "pyramidkv",
            "adakv",
            "criticalkv",
            "surrogatekv-global",
            "snapkv-lookahead",
        ],
    )
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--warmup",
        type=int,
        default=256,
        help="first run every press once, untimed, on this many tokens (0: none): lazy set-up and kvzip-head's "
        "one-time calibration (saved in the kvforge cache dir) stay out of the timings",
    )
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    sha = git_sha()
    if args.warmup:
        ids = text_ids(tokenizer, args.warmup)
        for name in args.presses:
            press = build_press(name, args.ratio)
            compress_prefill(model, ids, KVCache.for_model(model), press, args.chunk_size, tokenizer=tokenizer)
    for n in args.tokens:
        ids = text_ids(tokenizer, n)
        plain_times: list[float] = []
        plain_cpu: list[float] = []
        press_cpu: dict[str, list[float]] = {name: [] for name in args.presses}
        runs: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in args.presses}
        full_cache = full_logits = None
        caches: dict[str, tuple[KVCache, torch.Tensor]] = {}
        for _ in range(args.repeats):  # plain prefill and every press alternate: load drifts hit all alike
            cache = KVCache.for_model(model)
            secs, full_logits = timed(lambda c=cache, x=ids: prefill(model, x, c, chunk_size=args.chunk_size))
            plain_times.append(secs)
            plain_cpu.append(CPU_SECONDS[-1])
            full_cache = cache
            for name in args.presses:
                cache = KVCache.for_model(model)
                secs, logits = timed(
                    lambda c=cache, x=ids, p=name: compress_prefill(
                        model, x, c, build_press(p, args.ratio), args.chunk_size, tokenizer=tokenizer
                    )
                )
                runs[name].append((secs, cache.info["press"]["seconds"]))
                press_cpu[name].append(CPU_SECONDS[-1])
                caches[name] = (cache, logits)
        assert full_cache is not None and full_logits is not None
        full_bytes = full_cache.nbytes()
        full_tps = decode_speed(model, full_cache, full_logits, args.decode_steps) if args.decode_steps else None
        plain = statistics.median(plain_times)
        for name in args.presses:
            cache, logits = caches[name]
            times = [secs for secs, _ in runs[name]]
            stages = runs[name][-1][1]
            extra = [(st["lookahead"] + st["reconstruction"] + st["compress"]) / st["prefill"] for _, st in runs[name]]
            replay = [st["reconstruction"] / st["prefill"] for _, st in runs[name]]
            press = statistics.median(times)
            tps = decode_speed(model, cache, logits, args.decode_steps) if args.decode_steps else None
            row = {
                "git": sha,
                "device": "cpu",
                "threads": torch.get_num_threads(),
                "tokens": n,
                "press": name,
                "ratio": args.ratio,
                "repeats": args.repeats,
                "prefill_s": round(plain, 3),
                "press_s": round(press, 3),
                "overhead": round(statistics.median(extra), 4),
                "replay_vs_prefill": round(statistics.median(replay), 4),  # KVzip's replay stage / prefill stage
                "stages": stages,
                "e2e_overhead": round(press / plain - 1, 4),
                # process CPU seconds (1 thread): compress_prefill vs the plain prefill of the same repeat
                "prefill_cpu_s": round(statistics.median(plain_cpu), 3),
                "press_cpu_s": round(statistics.median(press_cpu[name]), 3),
                "cpu_overhead": round(
                    statistics.median(p / q - 1 for p, q in zip(press_cpu[name], plain_cpu, strict=True)), 4
                ),
                "cache_bytes": cache.nbytes(),
                "full_bytes": full_bytes,
                "decode_tps": None if tps is None else round(tps, 2),
                "full_decode_tps": None if full_tps is None else round(full_tps, 2),
            }
            print(json.dumps(row), flush=True)
            if args.out:
                append_rows(args.out, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
