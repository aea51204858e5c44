"""The GPU table on a random-initialised ~1B Llama-shaped model (weights cannot be downloaded; speed does not
need trained ones), bf16, one CUDA device:

    PYTHONPATH=src python benchmarks/gpu_table.py [--prefill-tokens 4096 16384] [--reuse-tokens 8192 32768]

Rows (one JSON line each, to results/performance/gpu_table.jsonl, then a markdown table):
- prefill tokens/s: kvforge chunked (default 512) and one-shot vs a one-shot transformers sdpa forward (alternating);
- decode tokens/s: kvforge's decode loop vs ``model.generate`` with a static cache, same prompt, greedy, prefill
  excluded ((N - 1) / (t(N) - t(1)));
- peak memory (``torch.cuda.max_memory_allocated``) of prefill + decode with the full cache vs AdaKV / KVzip at 25%;
- reuse TTFT: a prefix stored in the memory / disk store, loaded and the last 32 tokens prefilled on it, vs
  recomputing the whole prompt.
Needs CUDA; exits with a one-line message without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import RESULTS

from kvforge.cache import KVCache
from kvforge.decode import decode
from kvforge.prefill import DEFAULT_CHUNK_SIZE, prefill
from kvforge.presses import build_press, compress_prefill
from kvforge.provenance import git_sha
from kvforge.store import DiskStore, MemoryStore

LLAMA_1B = dict(  # Llama-3.2-1B's shape: 1.24B parameters
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)


def random_llama(device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_1B)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def ids_of(n: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    return torch.randint(100, vocab - 100, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)


@torch.inference_mode()
def prefill_rows(model: Any, lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for n in lengths:
        ids = ids_of(n, model.config.vocab_size, "cuda")
        runs = {
            "transformers_sdpa": lambda x=ids: model(input_ids=x, use_cache=True, logits_to_keep=1),
            "kvforge_chunked": lambda x=ids: prefill(model, x, KVCache.for_model(model)),
            "kvforge_one_shot": lambda x=ids: prefill(model, x, KVCache.for_model(model), chunk_size=None),
        }
        for fn in runs.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(repeats):
            for name, fn in runs.items():
                times[name].append(timed(fn))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            {"row": "prefill", "tokens": n, "chunk_size": DEFAULT_CHUNK_SIZE}
            | {f"{k}_tok_s": round(n / v, 1) for k, v in med.items()}
            | {
                "chunked_vs_sdpa": round(med["transformers_sdpa"] / med["kvforge_chunked"], 3),
                "one_shot_vs_sdpa": round(med["transformers_sdpa"] / med["kvforge_one_shot"], 3),
            }
        )
    return rows


@torch.inference_mode()
def decode_rows(model: Any, context: int, new_tokens: int, repeats: int) -> list[dict[str, Any]]:
    ids = ids_of(context, model.config.vocab_size, "cuda", seed=1)

    def ours(k: int) -> None:
        cache = KVCache.for_model(model)
        decode(model, cache, prefill(model, ids, cache), k)

    def hf(k: int) -> None:
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=k,
            min_new_tokens=k,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )

    out = {}
    for name, fn in (("kvforge", ours), ("generate_static", hf)):
        fn(2)
        full = statistics.median(timed(lambda f=fn: f(new_tokens)) for _ in range(repeats))
        one = statistics.median(timed(lambda f=fn: f(1)) for _ in range(repeats))
        out[name] = (new_tokens - 1) / (full - one)
    return [
        {"row": "decode", "context": context, "new_tokens": new_tokens}
        | {f"{k}_tok_s": round(v, 1) for k, v in out.items()}
        | {"ratio_vs_generate": round(out["kvforge"] / out["generate_static"], 3)}
    ]


@torch.inference_mode()
def memory_rows(model: Any, context: int, new_tokens: int) -> list[dict[str, Any]]:
    from kvforge.testing import tiny_tokenizer

    ids = ids_of(context, model.config.vocab_size, "cuda", seed=2)
    rows = []
    for name in ("full", "adakv", "kvzip"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cache = KVCache.for_model(model)
        if name == "full":
            logits = prefill(model, ids, cache)
        else:  # the replay prompt's wording does not matter for memory; any tokenizer encodes it
            logits = compress_prefill(model, ids, cache, build_press(name, 0.75), tokenizer=tiny_tokenizer())
        decode(model, cache, logits, new_tokens)
        rows.append(
            {
                "row": "peak_memory",
                "context": context,
                "press": name,
                "kept": 1.0 if name == "full" else 0.25,
                "peak_bytes": torch.cuda.max_memory_allocated() - base,
                "cache_bytes": cache.nbytes(),
            }
        )
        del cache
    return rows


@torch.inference_mode()
def reuse_rows(model: Any, lengths: list[int], repeats: int, suffix: int = 32) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        stores = {"memory": MemoryStore(max_bytes=8 << 30), "disk": DiskStore(Path(folder) / "kv")}  # 32k tokens: 1 GB
        for n in lengths:
            ids = ids_of(n, model.config.vocab_size, "cuda", seed=3)
            cache = KVCache.for_model(model)
            prefill(model, ids[:, :-suffix], cache)
            segment = cache.to_segment("gpu-table")
            del cache
            for store in stores.values():
                store.put(f"p{n}", segment)

            def recompute(x: torch.Tensor = ids) -> None:
                prefill(model, x, KVCache.for_model(model))

            def reuse(store: Any, key: str = f"p{n}", x: torch.Tensor = ids) -> None:
                seg = store.get(key)
                prefill(model, x[:, -suffix:], KVCache.from_segment(seg.to("cuda"), model))

            ttft = {"recompute": recompute} | {name: (lambda s=s: reuse(s)) for name, s in stores.items()}
            for fn in ttft.values():
                fn()
            med = {k: statistics.median(timed(fn) for _ in range(repeats)) for k, fn in ttft.items()}
            rows.append(
                {"row": "reuse_ttft", "tokens": n, "suffix": suffix}
                | {f"{k}_s": round(v, 4) for k, v in med.items()}
                | {f"{k}_speedup": round(med["recompute"] / med[k], 2) for k in stores}
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--decode-context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--memory-context", type=int, default=16384)
    ap.add_argument("--reuse-tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "performance" / "gpu_table.jsonl"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_table: no CUDA device here; this benchmark needs one (nothing was measured)", file=sys.stderr)
        return 2
    model = random_llama("cuda")
    sha = git_sha()
    meta = {
        "git": sha,
        "gpu": torch.cuda.get_device_name(),
        "dtype": "bfloat16",
        "params": sum(p.numel() for p in model.parameters()),
    }
    rows = prefill_rows(model, args.prefill_tokens, args.repeats)
    rows += decode_rows(model, args.decode_context, args.new_tokens, args.repeats)
    rows += memory_rows(model, args.memory_context, args.new_tokens)
    rows += reuse_rows(model, args.reuse_tokens, args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for row in rows:
            line = json.dumps(meta | row)
            print(line)
            f.write(line + "\n")
    print("\n| row | setting | result |\n| --- | --- | --- |")
    for row in rows:
        setting = {k: v for k, v in row.items() if k in ("tokens", "context", "press", "new_tokens", "suffix")}
        result = {k: v for k, v in row.items() if k not in setting and k != "row"}
        print(f"| {row['row']} | {setting} | {result} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
