"""``kvforge demo``: answer a question, then retrieve a pass key from a ~3k-token document, with timings."""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

from kvforge.commands._common import add_model_args, load, prefill_progress

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_document(num_tokens: int, tokenizer: Any, seed: int = 0) -> tuple[str, str]:
    """A pass-key retrieval document of about ``num_tokens`` tokens; returns (document, pass key)."""
    rng = random.Random(seed)
    key = str(rng.randint(10_000, 99_999))
    fact = f"The pass key is {key}. Remember it. {key} is the pass key. "
    per_filler = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    n = max(2, num_tokens // per_filler)
    at = rng.randint(n // 4, 3 * n // 4)
    body = FILLER * at + fact + FILLER * (n - at)
    intro = "There is an important piece of information hidden inside a lot of irrelevant text. Find it.\n\n"
    return intro + body, key


def register(sub: Any, bench_sub: Any) -> None:
    p = sub.add_parser("demo", help="short demo on the bundled model: a question, then a 3k-token pass-key retrieval")
    add_model_args(p)
    p.add_argument("--doc-tokens", type=int, default=3000, help="length of the pass-key document")
    p.set_defaults(func=run_demo)


def _report(label: str, gen: Any) -> None:
    print(
        f"    [{label}: prompt {gen.prompt_tokens} tokens, TTFT {gen.ttft_s:.2f} s, "
        f"{len(gen.token_ids)} tokens at {gen.tokens_per_s:.1f} tokens/s, KV cache {gen.cache_bytes / 2**20:.1f} MiB]"
    )


def run_demo(args: argparse.Namespace) -> int:
    from kvforge.engine import Engine
    from kvforge.request import Document, Request

    print(f"kvforge demo: loading {args.model} (offline)...", flush=True)
    model, tokenizer = load(args)
    engine = Engine(model, tokenizer)
    question = "What is the capital of France? Answer in one word."
    print(f"\n1) Q: {question}\n   A: ", end="", flush=True)
    gen = engine.run(Request(question, max_new_tokens=16))
    print(gen.text.strip())
    _report("chat", gen)

    document, key = passkey_document(args.doc_tokens, tokenizer)
    print("\n2) Pass-key retrieval from a long document", flush=True)
    question = "What is the pass key? Answer with the number only."
    gen = engine.run(Request(Document(document, question), max_new_tokens=12, on_prefill=prefill_progress()))
    found = key in gen.text
    print(f"   A: {gen.text.strip()}   (expected {key}: {'found' if found else 'NOT found'})")
    _report("retrieval", gen)
    print("\nNext: `kvforge generate --help`, `kvforge eval --help`, `kvforge serve --help`.")
    sys.stdout.flush()
    return 0 if found else 1
