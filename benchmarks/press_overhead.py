"""Compression overhead vs plain prefill, cache bytes kept, and decode speed compressed vs full.

    PYTHONPATH=src python benchmarks/press_overhead.py --tokens 2048 4096 8192 --presses snapkv adakv --ratio 0.75

One JSON line per (tokens, press): prefill_s (plain prefill, median), press_s (whole compress_prefill, median),
stages (compress_prefill's own per-stage clock: prefill / lookahead / reconstruction / compress), overhead =
(lookahead + reconstruction + compress) / prefill stage of the same run (robust to load drifting between runs on a
shared machine), e2e_overhead = press_s / prefill_s - 1, cache_bytes (kept) vs full_bytes, decode tokens/s with the
compressed and the full cache.
Model: smollm2-135m (bundled); tokens are natural text (Moby-Dick) so attention is realistic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from press_needle import load_smollm2

from kvforge.cache import KVCache
from kvforge.paths import default_data_dir
from kvforge.prefill import forward, prefill
from kvforge.presses import build_press, compress_prefill


def text_ids(tokenizer: Any, n: int) -> torch.Tensor:
    text = json.loads((default_data_dir() / "haystack_gutenberg" / "books.jsonl").open().readline())["text"]
    return torch.tensor([tokenizer.encode(text[: n * 8], add_special_tokens=False)[:n]])


@torch.inference_mode()
def decode_speed(model: Any, cache: KVCache, logits: torch.Tensor, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = forward(model, logits.argmax(-1, keepdim=True), cache)[:, -1]
    return steps / (time.perf_counter() - t0)


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
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
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for n in args.tokens:
        ids = text_ids(tokenizer, n)
        plain_times, full_cache, full_logits = [], None, None
        for _ in range(args.repeats):
            cache = KVCache.for_model(model)
            secs, full_logits = timed(lambda c=cache, x=ids: prefill(model, x, c, chunk_size=args.chunk_size))
            plain_times.append(secs)
            full_cache = cache
        assert full_cache is not None and full_logits is not None
        full_bytes = full_cache.nbytes()
        full_tps = decode_speed(model, full_cache, full_logits, args.decode_steps)
        for name in args.presses:
            times, overheads, cache, logits = [], [], None, None
            for _ in range(args.repeats):
                cache = KVCache.for_model(model)
                secs, logits = timed(
                    lambda c=cache, x=ids, p=name: compress_prefill(
                        model, x, c, build_press(p, args.ratio), args.chunk_size, tokenizer=tokenizer
                    )
                )
                times.append(secs)
                stages = cache.info["press"]["seconds"]
                overheads.append(
                    (stages["lookahead"] + stages["reconstruction"] + stages["compress"]) / stages["prefill"]
                )
            assert cache is not None and logits is not None
            plain, press = statistics.median(plain_times), statistics.median(times)
            print(
                json.dumps(
                    {
                        "git": sha,
                        "device": "cpu",
                        "threads": torch.get_num_threads(),
                        "tokens": n,
                        "press": name,
                        "ratio": args.ratio,
                        "prefill_s": round(plain, 3),
                        "press_s": round(press, 3),
                        "overhead": round(statistics.median(overheads), 4),
                        "stages": stages,
                        "e2e_overhead": round(press / plain - 1, 4),
                        "cache_bytes": cache.nbytes(),
                        "full_bytes": full_bytes,
                        "decode_tps": round(decode_speed(model, cache, logits, args.decode_steps), 2),
                        "full_decode_tps": round(full_tps, 2),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
