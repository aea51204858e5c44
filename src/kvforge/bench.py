"""Decode-speed measurement shared by ``kvforge bench decode`` and ``benchmarks/decode.py``."""

from __future__ import annotations

import platform
import time
from typing import Any

import torch

from kvforge import compat
from kvforge.decode import decode_uncached
from kvforge.engine import Engine


def _best(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@torch.inference_mode()
def bench_decode(
    model: Any, tokenizer: Any, prompt: str, max_new_tokens: int = 200, uncached_tokens: int | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """Decode tokens/s of kvforge's cached loop, the no-cache baseline and transformers' ``generate``.

    Cached and ``generate`` rates exclude the prefill: (N - 1) / (t(N tokens) - t(1 token)), same prompt, greedy,
    EOS ignored so both produce exactly N tokens. The uncached rate is tokens / total time (recomputing is its cost).
    """
    engine = Engine(model, tokenizer)
    engine.eos_token_ids = []  # exactly max_new_tokens tokens
    ids = engine.encode_chat(prompt)
    n = max_new_tokens

    def ours(k: int) -> None:
        engine.generate(ids, max_new_tokens=k)

    ours(2)  # warm-up
    cached_s = _best(lambda: ours(n), repeats) - _best(lambda: ours(1), repeats)

    m = uncached_tokens or n
    start = time.perf_counter()
    decode_uncached(model, ids, m)
    uncached_s = time.perf_counter() - start

    with compat.attn_implementation(model, "sdpa"):
        input_ids = torch.tensor([ids], device=model.device)
        mask = torch.ones_like(input_ids)

        def hf(k: int) -> None:
            model.generate(input_ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                           pad_token_id=tokenizer.eos_token_id)

        hf(2)
        hf_s = _best(lambda: hf(n), repeats) - _best(lambda: hf(1), repeats)
    cached_tok_s = (n - 1) / cached_s
    uncached_tok_s = m / uncached_s
    hf_tok_s = (n - 1) / hf_s
    return {
        "prompt_tokens": len(ids),
        "max_new_tokens": n,
        "cached_tok_s": round(cached_tok_s, 2),
        "uncached_tok_s": round(uncached_tok_s, 2),
        "hf_generate_tok_s": round(hf_tok_s, 2),
        "speedup_vs_uncached": round(cached_tok_s / uncached_tok_s, 2),
        "ratio_vs_hf_generate": round(cached_tok_s / hf_tok_s, 3),
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "git_sha": _git_sha(),
    }


def _git_sha() -> str:
    from kvforge.provenance import git_sha

    return git_sha()
