"""TTFT cold (full prefill) vs warm (prefix reuse from a store) per store tier and prompt length.

One JSON line per (length, store) on stdout and appended to ``benchmarks/results/reuse_ttft.jsonl``; the same
measurement as ``kvforge bench reuse`` (:func:`kvforge.reuse.ttft.measure_reuse_ttft`).

    redis-server --port 6391 --save "" &
    PYTHONPATH=src python benchmarks/reuse_ttft.py --model smollm2-135m --lengths 1024,2048,4096,8192 \
        --store memory:// --store file:///tmp/kvbench --store redis://127.0.0.1:6391/0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--store", action="append", default=None, help="store URL (repeatable); default memory://")
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 = stable on a busy machine)")
    parser.add_argument("--out", type=Path, default=RESULTS / "reuse_ttft.jsonl")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from kvforge.bench import _git_sha
    from kvforge.engine import Engine
    from kvforge.model import load_model
    from kvforge.reuse.ttft import measure_reuse_ttft

    model, tokenizer = load_model(args.model)
    engine = Engine(model, tokenizer, chunk_size=args.chunk_size)
    lengths = [int(x) for x in args.lengths.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for row in measure_reuse_ttft(
            engine, args.store or ["memory://"], lengths, repeats=args.repeats, block_size=args.block_size
        ):
            row |= {
                "model": args.model,
                "device": str(model.device),
                "dtype": str(model.dtype),
                "threads": torch.get_num_threads(),
                "git_sha": _git_sha(),
            }
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
