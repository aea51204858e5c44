"""Stored bytes and answer quality of quantised KV storage (int8 / int4 / int2, KIVI-style group-wise).

    PYTHONPATH=src python benchmarks/quant_bytes.py                       # bytes only (synthetic, seconds)
    PYTHONPATH=src python benchmarks/quant_bytes.py --needle 6 --length 1024   # + needle quality on smollm2-135m

Bytes: one JSON line per (shape, dtype, scheme) with the encoded segment's size (header, positions and scales
included) against the fp32 and fp16 caches of the same shape. Needle: the context is prefilled on smollm2-135m, its
cache goes through the store codec (:func:`kvforge.store.quant_roundtrip`, exactly as a store would write and read
it), then the question is prefilled on top and answered; per scheme the normalised score against the unquantised run
(100 = as good as full KV) and the mean KL of the first answer token's distribution.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvforge.cache import KVCache
from kvforge.store import quant_roundtrip
from kvforge.store.codec import encode
from kvforge.types import KVSegment

SCHEMES = ["none", "int8", "int4", "int4-g64", "int2", "int2-g64"]


def synthetic(layers: int, heads: int, tokens: int, dim: int, dtype: torch.dtype) -> KVSegment:
    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(heads, tokens, dim, generator=g).to(dtype) for _ in range(2 * layers)]
    pos = torch.arange(tokens).expand(heads, tokens).contiguous()
    return KVSegment(token_ids=list(range(tokens)), keys=kv[:layers], values=kv[layers:], positions=[pos] * layers,
                     valid=[None] * layers, next_position=tokens, model_id="synthetic")  # fmt: skip


def bytes_rows(shapes: list[tuple[int, int, int, int]]) -> None:
    for layers, heads, tokens, dim in shapes:
        elems = 2 * layers * heads * tokens * dim
        for dtype in (torch.float32, torch.float16):
            seg = synthetic(layers, heads, tokens, dim, dtype)
            for scheme in SCHEMES:
                n = len(encode(seg, None if scheme == "none" else scheme))
                print(json.dumps({"bench": "quant_bytes", "layers": layers, "kv_heads": heads, "tokens": tokens,
                                  "head_dim": dim, "dtype": str(dtype).removeprefix("torch."), "quant": scheme,
                                  "stored_bytes": n, "vs_fp32": round(n / (4 * elems), 4),
                                  "vs_fp16": round(n / (2 * elems), 4)}), flush=True)  # fmt: skip


@torch.inference_mode()
def needle_rows(num: int, length: int, schemes: list[str]) -> None:
    from kvforge.engine import Engine
    from kvforge.eval.metrics import score_prediction
    from kvforge.eval.tasks.base import TaskConfig
    from kvforge.eval.tasks.needle import needle_task
    from kvforge.model import load_model
    from kvforge.paths import default_data_dir

    model, tok = load_model("smollm2-135m")
    engine = Engine(model, tok)
    depths = tuple(round((i + 0.5) / num, 3) for i in range(num))
    examples = needle_task(TaskConfig(data_dir=default_data_dir(), tokenizer=tok, lengths=(length,), depths=depths))
    totals: dict[str, list[float]] = {s: [] for s in schemes}
    kls: dict[str, list[float]] = {s: [] for s in schemes}
    for ex in examples:
        ctx, q = engine.encode_qa(ex.context, ex.question, system=ex.system, answer_prefix=ex.answer_prefix)
        cache, _ = engine.prefill(ctx)
        seg = cache.to_segment(model_id="smollm2-135m", token_ids=ctx)
        ref = None
        for scheme in schemes:
            stored = quant_roundtrip(seg, None if scheme == "none" else scheme)
            c, logits = engine.prefill(q, KVCache.from_segment(stored, model))
            logp = torch.log_softmax(logits[0].float(), -1)  # (V,): logits are the last token's (1, V)
            ref = logp if ref is None else ref
            kl = float((ref.exp() * (ref - logp)).sum())
            gen = engine.decode(c, logits, ex.max_new_tokens)
            score = score_prediction(gen.text, ex.answers, ex.metric)
            totals[scheme].append(score)
            kls[scheme].append(kl)
            print(json.dumps({"bench": "quant_needle", "id": ex.id, "quant": scheme, "score": score,
                              "kl_first_token": round(kl, 6), "answer": gen.text[:60]}), flush=True)  # fmt: skip
    full = sum(totals[schemes[0]]) / len(examples)
    for scheme in schemes:
        mean = sum(totals[scheme]) / len(examples)
        print(json.dumps({"bench": "quant_needle_summary", "quant": scheme, "examples": len(examples),
                          "length": length, "score": round(mean, 4),
                          "normalised": round(100 * mean / full, 1) if full else None,
                          "mean_kl_first_token": round(sum(kls[scheme]) / len(examples), 6)}), flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--needle", type=int, default=0, help="needle examples (depths) on smollm2-135m; 0 = bytes only")
    ap.add_argument("--length", type=int, default=1024, help="needle context length in tokens")
    ap.add_argument("--schemes", nargs="+", default=["none", "int8", "int4", "int2"])
    args = ap.parse_args()
    bytes_rows([(30, 3, 1024, 64), (4, 3, 1000, 64)])
    if args.needle:
        needle_rows(args.needle, args.length, args.schemes)


if __name__ == "__main__":
    main()
