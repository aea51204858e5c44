"""TTFT cold (full prefill) vs warm (prefix reuse from a store) per store tier and prompt length.

One JSON line per (length, store) on stdout and appended to ``results/performance/reuse_ttft.jsonl``. Every run is an
engine request (``Engine.run``): cold = a miss lookup + the full prefill (then recorded), warm = the store reopened
(file/redis: a fresh index, as another process would see it), the longest prefix loaded and the rest prefilled,
median of ``--repeats``; ``max_abs_logit_diff`` compares the warm first-token logits with the cold ones.

    redis-server --port 6391 --save "" &
    PYTHONPATH=src python benchmarks/reuse_ttft.py --model smollm2-135m --lengths 1024,2048,4096,8192 \\
        --store memory:// --store file:///tmp/kvbench --store redis://127.0.0.1:6391/0
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from common import RESULTS


def haystack_ids(tokenizer: Any, num_tokens: int) -> list[int]:
    """``num_tokens`` token ids of the haystack (RULER's essays when the shared data is there, else the public-domain
    excerpt bundled with kvforge), repeated if needed."""
    from kvforge.eval.tasks.needle import read_haystack
    from kvforge.paths import default_data_dir, haystack_files

    files = haystack_files(default_data_dir())
    text = read_haystack(tuple(files))[: num_tokens * 6]
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def _prefilled(engine: Any, ids: list[int], reuse: Any) -> Any:
    """The engine's sequence for ``ids`` prefilled on ``reuse`` (generates nothing: TTFT = plan + prefill)."""
    from kvforge.request import Request

    seq = engine.add(Request(ids, max_new_tokens=0, reuse=reuse))
    gen = engine.complete(seq)
    int(seq.logits.argmax(-1))  # the first token is picked: TTFT ends here
    return seq, gen


def measure(engine: Any, store_urls: Sequence[str], lengths: Sequence[int], repeats: int, block_size: int
            ) -> Iterator[dict[str, Any]]:  # fmt: skip
    """One row per (length, store). Keys live in a per-run namespace and are deleted afterwards."""
    from kvforge.reuse import PrefixReuse
    from kvforge.store import open_store

    run_id = f"{engine.model_id}-bench-{uuid.uuid4().hex[:8]}"
    for length in lengths:
        ids = haystack_ids(engine.tokenizer, length)
        for url in store_urls:
            store = open_store(url)
            cold, gen = _prefilled(engine, ids, PrefixReuse(store, run_id, block_size=block_size))
            assert cold.plan.kind == "miss", "a benchmark run namespace is fresh: the first lookup must miss"
            warm_store = store if url.startswith("memory://") else open_store(url)
            warm = PrefixReuse(warm_store, run_id, block_size=block_size)
            runs = [_prefilled(engine, ids, warm) for _ in range(repeats)]
            warm_s = statistics.median(g.ttft_s for _, g in runs)
            yield {
                "bench": "reuse_ttft",
                "store": url,
                "prompt_tokens": length,
                "reused_tokens": runs[-1][0].plan.reused_tokens,
                "cold_ttft_s": round(gen.ttft_s, 4),
                "warm_ttft_s": round(warm_s, 4),
                "ttft_reduction": round(1 - warm_s / gen.ttft_s, 4),
                "load_s": round(statistics.median(s.plan_s for s, _ in runs), 4),
                "record_s": gen.reuse.record_s,
                "stored_mib": round(sum(store.stored_size(k) or 0 for k in warm.block_keys(ids)) / 2**20, 2),
                "max_abs_logit_diff": max(float((s.logits - cold.logits).abs().max()) for s, _ in runs),
                "repeats": repeats,
                "block_size": block_size,
            }
            for key in warm.block_keys(ids):
                store.delete(key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--store", action="append", default=None, help="store URL (repeatable); default memory://")
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 = stable on a busy machine)")
    parser.add_argument("--out", type=Path, default=RESULTS / "performance" / "reuse_ttft.jsonl")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from kvforge.engine import Engine
    from kvforge.model import load_model
    from kvforge.provenance import git_sha

    model, tokenizer = load_model(args.model)
    engine = Engine(model, tokenizer, chunk_size=args.chunk_size)
    lengths = [int(x) for x in args.lengths.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for row in measure(engine, args.store or ["memory://"], lengths, args.repeats, args.block_size):
            row |= {"model": args.model, "device": str(model.device), "dtype": str(model.dtype),
                    "threads": torch.get_num_threads(), "git_sha": git_sha()}  # fmt: skip
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
