"""``kvforge rag``: answer a question over documents with chunk KV reuse; reports reuse and TTFT on stderr."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvforge.commands._common import add_model_args, input_file, load, prefill_progress, read_text_file
from kvforge.errors import UserError
from kvforge.names import RAG_STRATEGY_NAMES


def open_segment_store(url: str | None) -> Any:
    if url is None:
        return None
    from kvforge.store import open_store

    return open_store(url)


def run(args: argparse.Namespace) -> int:
    from kvforge.engine import Engine
    from kvforge.request import Chunks, Request
    from kvforge.reuse.rag import ChunkReuse, make_strategy

    docs = [read_text_file(f) for f in args.docs]
    if args.recompute_ratio is not None and not 0.0 <= args.recompute_ratio <= 1.0:
        raise UserError(f"--recompute-ratio must be in [0, 1], got {args.recompute_ratio}")
    if args.aux_model and args.strategy != "cacheclip":
        raise UserError("--aux-model only applies to --strategy cacheclip")
    if args.recompute_tokens is not None:
        if not args.strategy.startswith("epic"):
            raise UserError("--recompute-tokens only applies to --strategy epic / epic-ape")
        if args.recompute_ratio is not None:
            raise UserError("--recompute-tokens and --recompute-ratio do not combine (tokens per chunk, or a share)")
        if args.recompute_tokens < 0:
            raise UserError(f"--recompute-tokens must be >= 0, got {args.recompute_tokens}")
    store = open_segment_store(args.store)
    model, tokenizer = load(args)
    engine = Engine(model, tokenizer)
    kwargs: dict[str, Any] = {}
    if args.recompute_tokens is not None:
        kwargs["recompute_tokens"] = args.recompute_tokens
    if args.aux_model:
        aux_args = argparse.Namespace(model=args.aux_model, device=args.device, dtype=args.dtype)
        kwargs["aux"] = ChunkReuse(*load(aux_args), store=store)
    method = make_strategy(args.strategy, args.recompute_ratio, **kwargs)
    rag = ChunkReuse(model, tokenizer, store, model_id=engine.model_id, method=method)
    rag.on_chunk_loaded = prefill_progress()  # a bar over the documents' tokens (computed or loaded) when long
    separator = args.separator.encode().decode("unicode_escape")
    gen = engine.run(Request(Chunks(docs, args.question, args.system, separator), args.max_new_tokens, reuse=rag))
    print(gen.text.strip())
    facts = gen.reuse.chunks if gen.reuse is not None else None
    counts = (facts.recomputed_tokens, facts.fresh_tokens, facts.chunk_hits, facts.chunk_misses) if facts else None
    recomputed, fresh, hits, misses = counts or (gen.prompt_tokens, 0, 0, 0)
    print(
        f"strategy={args.strategy} tokens={gen.prompt_tokens} reused={gen.reused_tokens} recomputed={recomputed} "
        f"fresh={fresh} ttft={gen.ttft_s:.3f}s chunk_hits={hits} chunk_misses={misses}",
        file=sys.stderr,
    )
    return 0


def register(sub: Any, bench_sub: Any) -> None:
    p = sub.add_parser("rag", help="answer over documents reusing per-chunk KV (naive, ape, cacheblend, cacheclip, "
                       "epic)")
    add_model_args(p)
    p.add_argument(
        "--docs", nargs="+", type=input_file, required=True, metavar="FILE", help="one document (chunk) per text file"
    )
    p.add_argument("--question", required=True)
    p.add_argument("--strategy", default="cacheclip", choices=RAG_STRATEGY_NAMES)
    p.add_argument("--recompute-ratio", type=float, default=None, help="share of context tokens recomputed (0.2)")
    p.add_argument("--recompute-tokens", type=int, default=None,
                   help="epic: tokens recomputed at the start of each chunk (16; instead of --recompute-ratio)")
    p.add_argument("--store", default=None, help="chunk KV store URL, e.g. file:///dir (default: in memory)")
    p.add_argument("--aux-model", default=None, help="CacheClip auxiliary model (default: the model itself)")
    p.add_argument("--system", default=None, help="system prompt (part of the shared prefix)")
    p.add_argument("--separator", default="\\n\\n", help="text between documents (escapes allowed)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.set_defaults(func=run)
