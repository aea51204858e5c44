"""Decode speed on the bundled model: kvforge cached vs uncached (the tutorial's baseline) vs transformers' generate.

    python benchmarks/decode.py --model smollm2-135m --max-new-tokens 200 [--repeats 3]

Prints one JSON line and appends it to benchmarks/results/decode.jsonl. Targets: speedup_vs_uncached >= 5,
ratio_vs_hf_generate >= 1.0 (same model, greedy, same prompt; rates exclude the prefill).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from transformers.utils import logging as hf_logging

from kvforge.bench import bench_decode
from kvforge.model import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--uncached-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default="Write a long story about a lighthouse keeper and the sea.")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode.jsonl"))
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    model, tokenizer = load_model(args.model, device=args.device)
    row = bench_decode(model, tokenizer, args.prompt, args.max_new_tokens, args.uncached_tokens, args.repeats)
    row = {"bench": "decode", "model": args.model, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}
    print(json.dumps(row))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
