"""FLOP lower bound of KVzip's exact replay against the prefill it compresses (no model run: shapes only).

    python benchmarks/kvzip_replay_flops.py --tokens 2048 4096 8192

Counts multiply-adds as 2 FLOPs, from the model's shapes (defaults: SmolLM2-135M: hidden 576, 30 layers, 9 query /
3 KV heads of 64, MLP 1536; the LM head runs for one token per forward in both and is left out):
- dense, per token and layer: q/k/v/o projections + gated MLP = 2 (h·Hq·d + 2 h·Hkv·d + Hq·d·h + 3 h·I);
- attention, per (query, visible key) pair and layer: q·k and p·v = 4 Hq·d; the prefill's queries see the keys before
  them (S(S+1)/2 pairs); a replay forward's queries (request + chunk of the context) see the whole prompt (S keys) and
  the replay's keys before them;
- KVzip's score, per (replay query, key of the chunk it repeats) and layer: one (d+1)-wide product = 2 Hq (d+1).
  A kernel that returned each key's max probability with the attention would not need it; torch's do not.
The replay's request is ``--first-request`` tokens before the first chunk and ``--later-request`` before later ones
(SmolLM2's chat template: 14 and 27). Ratios are replay / prefill: the dense work alone is already ~1.0x.
"""

from __future__ import annotations

import argparse
import json


def flops(args: argparse.Namespace, s: int) -> dict[str, float]:
    h, hq, hkv, d, inter, layers = args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate, args.layers
    dense = 2 * (h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * inter) * layers  # per token
    pair = 4 * hq * d * layers  # attention, per (query, key)
    score = 2 * hq * (d + 1) * layers  # KVzip's score product, per (query, chunk key)
    prefill_dense, prefill_attn = dense * s, pair * s * (s + 1) / 2
    chunk = args.replay_chunk or s
    r_dense = r_attn = r_score = 0.0
    for a in range(0, s, chunk):
        n = min(chunk, s - a)
        q = (args.first_request if a == 0 else args.later_request) + n
        r_dense += dense * q
        r_attn += pair * (q * s + q * (q + 1) / 2)
        r_score += score * q * n
    prefill = prefill_dense + prefill_attn
    g = 1e9
    return {
        "tokens": s,
        "prefill_gflop": round(prefill / g),
        "prefill_dense_gflop": round(prefill_dense / g),
        "prefill_attention_gflop": round(prefill_attn / g),
        "replay_dense_gflop": round(r_dense / g),
        "replay_attention_gflop": round(r_attn / g),
        "replay_score_gflop": round(r_score / g),
        "bound_dense_attention": round((r_dense + r_attn) / prefill, 2),
        "bound_with_score": round((r_dense + r_attn + r_score) / prefill, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--replay-chunk", type=int, default=2048)
    ap.add_argument("--first-request", type=int, default=14)
    ap.add_argument("--later-request", type=int, default=27)
    args = ap.parse_args(argv)
    for s in args.tokens:
        print(json.dumps(flops(args, s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
