"""``kvforge rag``: answer a question over documents with chunk KV reuse; reports reuse and TTFT on stderr."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvforge.commands._common import add_model_args, load, read_text_file
from kvforge.errors import UserError
from kvforge.names import RAG_STRATEGY_NAMES


def open_segment_store(url: str | None) -> Any:
    if url is None:
        return None
    from kvforge.store import open_store

    return open_store(url)


def run(args: argparse.Namespace) -> int:
    from kvforge.rag import RagModel, make_strategy

    docs = [read_text_file(f) for f in args.docs]
    if args.recompute_ratio is not None and not 0.0 <= args.recompute_ratio <= 1.0:
        raise UserError(f"--recompute-ratio must be in [0, 1], got {args.recompute_ratio}")
    if args.aux_model and args.strategy != "cacheclip":
        raise UserError("--aux-model only applies to --strategy cacheclip")
    store = open_segment_store(args.store)
    model, tokenizer = load(args)
    rag = RagModel(model, tokenizer, store)
    kwargs: dict[str, Any] = {}
    if args.aux_model:
        aux_args = argparse.Namespace(model=args.aux_model, device=args.device, dtype=args.dtype)
        kwargs["aux"] = RagModel(*load(aux_args), store=store)
    strategy = make_strategy(args.strategy, args.recompute_ratio, **kwargs)
    separator = args.separator.encode().decode("unicode_escape")
    try:
        prompt = rag.build_prompt(docs, args.question, system=args.system, separator=separator)
    except ValueError as e:
        raise UserError(str(e)) from e
    start = time.perf_counter()
    strategy.warm(rag, prompt)  # precompute + store chunks (a hit when --store already holds them)
    warm_s = time.perf_counter() - start
    result = rag.prefill(prompt, strategy)
    from kvforge.rag.pipeline import greedy_decode

    ids = greedy_decode(rag.model, tokenizer, result.cache, result.logits, args.max_new_tokens)
    print(tokenizer.decode(ids, skip_special_tokens=True).strip())
    print(
        f"strategy={result.strategy} tokens={result.num_tokens} reused={result.num_reused} "
        f"recomputed={result.num_recomputed} fresh={result.num_fresh} ttft={result.ttft_s:.3f}s "
        f"precompute={warm_s:.3f}s chunk_hits={rag.chunks.num_hits} chunk_misses={rag.chunks.num_misses}",
        file=sys.stderr,
    )
    return 0


def register(sub: Any, bench_sub: Any) -> None:
    p = sub.add_parser("rag", help="answer over documents reusing per-chunk KV (naive, ape, cacheblend, cacheclip)")
    add_model_args(p)
    p.add_argument("--docs", nargs="+", required=True, metavar="FILE", help="one document (chunk) per text file")
    p.add_argument("--question", required=True)
    p.add_argument("--strategy", default="cacheclip", choices=RAG_STRATEGY_NAMES)
    p.add_argument("--recompute-ratio", type=float, default=None, help="share of context tokens recomputed (0.2)")
    p.add_argument("--store", default=None, help="chunk KV store URL, e.g. file:///dir (default: in memory)")
    p.add_argument("--aux-model", default=None, help="CacheClip auxiliary model (default: the model itself)")
    p.add_argument("--system", default=None, help="system prompt (part of the shared prefix)")
    p.add_argument("--separator", default="\\n\\n", help="text between documents (escapes allowed)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.set_defaults(func=run)
