"""Decode speed on the bundled model: kvforge cached vs uncached (the tutorial's baseline) vs transformers' generate.

    python benchmarks/decode.py --model smollm2-135m --max-new-tokens 200 [--repeats 3]

Prints one JSON line and appends it to results/performance/decode.jsonl. Targets: speedup_vs_uncached >= 5,
ratio_vs_hf_generate >= 1.0 (same model, greedy, same prompt; rates exclude the prefill).

What compression buys at decode time: with ``--contexts``, decode tokens/s at each context length with the
full cache, with SnapKV / AdaKV (head-wise) / KVzip keeping 50% and 25%, and with the full cache stored as int8 / int4
and loaded back; resident cache bytes next to each speed:

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/decode.py --contexts 2048 4096 8192 --threads 1

The prompt is prefilled once per length; every configuration starts from that prefill (compressed from it, or its
segment quantised and loaded back) and decodes ``--steps`` tokens; repeats alternate the configurations so load
drift hits all alike; tok/s is the median, per wall second and per CPU second of this process (which other jobs on a
shared machine do not inflate). KVzip's replay (a second pass over the context) is done once per length and is not
timed: only its decode is. One JSON line per (length, configuration) to
results/performance/decode_compressed.jsonl, with ``vs_full`` = its tok/s / the full cache's tok/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, append_rows
from transformers.utils import logging as hf_logging

from kvforge.bench import bench_decode
from kvforge.cache import KVCache
from kvforge.model import load_model
from kvforge.paths import haystack_files
from kvforge.prefill import forward
from kvforge.presses import CompressionSource, build_press
from kvforge.presses.base import Needs
from kvforge.provenance import git_sha
from kvforge.store.codec import encode, quant_roundtrip

COMPRESSED = ("snapkv", "adakv", "kvzip")
QUANTISED = ("int8", "int4")


def context_ids(tokenizer: Any, n: int) -> torch.Tensor:
    """``n`` tokens of natural text (the haystack, repeated if short)."""
    text = "\n".join(f.read_text() if f.suffix == ".txt" else f.read_text()[:200_000] for f in haystack_files()[:2])
    ids = tokenizer.encode(text, add_special_tokens=False)
    return torch.tensor([(ids * (n // max(len(ids), 1) + 1))[:n]])


@torch.inference_mode()
def decode_tok_s(model: Any, cache: KVCache, logits: torch.Tensor, steps: int) -> tuple[float, float]:
    """Greedy decode ``steps`` tokens on ``cache``; tokens per wall second and per CPU second of this process."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        logits = forward(model, logits.argmax(-1, keepdim=True).reshape(1, 1), cache)[:, -1]
    return steps / (time.perf_counter() - start), steps / (time.process_time() - cpu)


def compressed_table(model: Any, tokenizer: Any, args: argparse.Namespace) -> None:
    sha = git_sha()
    out = Path(args.out).with_name("decode_compressed.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    for n in args.contexts:
        ids = context_ids(tokenizer, n)
        presses = {f"{p}@{k}": build_press(p, 1 - k) for p in args.presses for k in args.kept}
        needs = Needs()
        for press in presses.values():
            needs = needs.merge(press.needs())
        t0 = time.perf_counter()
        source = CompressionSource(model, ids, KVCache.for_model(model), needs, tokenizer=tokenizer)
        prefill_s = time.perf_counter() - t0
        logits = source.logits
        full = source.restore().to_segment()
        stored = {q: len(encode(full, q)) for q in args.quant}
        loaded = {q: quant_roundtrip(full, q) for q in args.quant}
        setups: dict[str, Callable[[], KVCache]] = {"full": lambda f=full: KVCache.from_segment(f, model)}
        setups |= {name: (lambda p=press, src=source: src.compress(p)) for name, press in presses.items()}
        setups |= {q: (lambda s=seg: KVCache.from_segment(s, model)) for q, seg in loaded.items()}
        for setup in setups.values():  # warm-up, and KVzip's replay (once per length, shared, not timed)
            setup()
        rates: dict[str, list[float]] = {name: [] for name in setups}
        cpu_rates: dict[str, list[float]] = {name: [] for name in setups}
        resident: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, setup in setups.items():
                cache = setup()
                resident[name] = cache.nbytes()
                wall, cpu = decode_tok_s(model, cache, logits, args.steps)
                rates[name].append(wall)
                cpu_rates[name].append(cpu)
        full_rate, full_cpu = statistics.median(rates["full"]), statistics.median(cpu_rates["full"])
        for name, r in rates.items():
            rate, cpu_rate = statistics.median(r), statistics.median(cpu_rates[name])
            row = {
                "bench": "decode_compressed",
                "model": args.model,
                "git": sha,
                "threads": torch.get_num_threads(),
                "device": str(model.device),
                "context": n,
                "config": name,
                "steps": args.steps,
                "repeats": args.repeats,
                "tok_s": round(rate, 2),
                "vs_full": round(rate / full_rate, 3),
                "tok_per_cpu_s": round(cpu_rate, 2),
                "vs_full_cpu_time": round(cpu_rate / full_cpu, 3),
                "resident_bytes": resident[name],
                "stored_bytes": stored.get(name),
                "prefill_s": round(prefill_s, 2),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
            print(json.dumps(row), flush=True)
            append_rows(out, row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--uncached-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default="Write a long story about a lighthouse keeper and the sea.")
    parser.add_argument("--out", default=str(RESULTS / "performance" / "decode.jsonl"))
    parser.add_argument(
        "--contexts", type=int, nargs="*", default=None, help="compressed-vs-full table at these lengths"
    )
    parser.add_argument("--presses", nargs="+", default=list(COMPRESSED), help="with --contexts")
    parser.add_argument("--kept", type=float, nargs="+", default=[0.5, 0.25], help="fractions kept, with --contexts")
    parser.add_argument("--quant", nargs="*", default=list(QUANTISED), help="stored formats loaded back")
    parser.add_argument("--steps", type=int, default=16, help="decoded tokens per configuration (--contexts)")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    model, tokenizer = load_model(args.model, device=args.device)
    if args.contexts:
        compressed_table(model, tokenizer, args)
        return
    row = bench_decode(model, tokenizer, args.prompt, args.max_new_tokens, args.uncached_tokens, args.repeats)
    row = {"bench": "decode", "model": args.model, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}
    print(json.dumps(row))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    append_rows(args.out, row)


if __name__ == "__main__":
    main()
