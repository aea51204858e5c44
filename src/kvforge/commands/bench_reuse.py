"""``kvforge bench reuse`` (cold vs warm TTFT per store tier) and the ``--reuse`` plumbing of ``kvforge generate``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvforge.commands._common import add_model_args, check_store_url, load, positive_int, prefill_progress
from kvforge.errors import PRESS_WITH_REUSE, UserError


def register(sub: Any, bench_sub: Any) -> None:
    b = bench_sub.add_parser("reuse", help="TTFT cold vs warm (prefix reuse) per store: one JSON line per length/store")
    add_model_args(b)
    b.add_argument(
        "--store",
        action="append",
        default=None,
        help="store URL (repeatable: one row per store; comma-separated = one tiered store); default memory://",
    )
    b.add_argument("--lengths", default="1024,2048,4096,8192", help="prompt lengths in tokens, comma-separated")
    b.add_argument("--repeats", type=positive_int, default=3, help="warm runs per configuration (median)")
    b.add_argument("--block-size", type=positive_int, default=256)
    b.add_argument("--chunk-size", type=positive_int, default=512, help="prefill chunk size in tokens")
    b.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    b.set_defaults(func=run_bench_reuse)


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--lengths must be comma-separated integers, got {text!r}") from None
    if not lengths or min(lengths) < 2:
        raise UserError("--lengths must hold integers >= 2")
    return lengths


def run_bench_reuse(args: argparse.Namespace) -> int:
    import torch

    from kvforge.bench import _git_sha
    from kvforge.engine import Engine
    from kvforge.reuse.ttft import measure_reuse_ttft

    lengths = _lengths(args.lengths)
    if args.threads:
        torch.set_num_threads(args.threads)
    for url in args.store or []:
        check_store_url(url)
    model, tokenizer = load(args)
    engine = Engine(model, tokenizer, chunk_size=args.chunk_size)
    engine.on_prefill_chunk = prefill_progress()
    for row in measure_reuse_ttft(
        engine, args.store or ["memory://"], lengths, repeats=args.repeats, block_size=args.block_size
    ):
        row |= {"model": args.model, "device": str(model.device), "dtype": str(model.dtype), "git_sha": _git_sha()}
        row["threads"] = torch.get_num_threads()
        print(json.dumps(row), flush=True)
    return 0


def check_reuse_args(args: argparse.Namespace) -> Any:
    """Check ``--reuse`` and its options and open its store (an unreachable server fails here, before the model
    loads); returns the store."""
    from kvforge.store import default_store_url, open_store

    if getattr(args, "press", None):  # the compressed document is stored and reused: query-agnostic, prefix reuse
        document = getattr(args, "prompt_file", None) and getattr(args, "prompt", None)
        if args.reuse != "prefix" or not getattr(args, "query_agnostic", False) or not document:
            raise UserError(PRESS_WITH_REUSE)
    if getattr(args, "window", None):
        raise UserError("--reuse cannot be combined with --window")
    check_semantic_args(args)
    check_store_url(args.store)
    return open_store(args.store or default_store_url())


def check_semantic_args(args: argparse.Namespace) -> None:
    """``--threshold``, ``--max-error`` and ``--verify-ratio`` in range and not in conflict (before any heavy import:
    the same rules as :func:`kvforge.reuse.check_semantic_options`)."""
    threshold, max_error, ratio = (getattr(args, k, None) for k in ("threshold", "max_error", "verify_ratio"))
    if any(v is not None for v in (threshold, max_error, ratio)) and getattr(args, "reuse", None) != "semantic":
        raise UserError("--threshold, --max-error and --verify-ratio apply to --reuse semantic")
    if threshold is not None and max_error is not None:
        raise UserError("give --threshold (a fixed similarity) or --max-error (a bounded error rate), not both")
    if threshold is not None and not -1 <= threshold <= 1:
        raise UserError(f"--threshold is a cosine similarity in [-1, 1], got {threshold}")
    if max_error is not None and not 0 < max_error < 1:
        raise UserError(f"--max-error is a rate in (0, 1), got {max_error}")
    if ratio is not None and not 0 <= ratio <= 1:
        raise UserError(f"--verify-ratio is a share in [0, 1], got {ratio}")


def attach_reuse(engine: Any, args: argparse.Namespace, store: Any = None) -> None:
    """Give ``engine`` the reuse strategy named by ``--reuse`` over the store of ``--store`` (or ``store``)."""
    from kvforge.reuse import build_reuse

    if store is None:
        store = check_reuse_args(args)
    engine.reuse = build_reuse(
        args.reuse,
        store,
        engine.model_id,
        semantic_mode=args.semantic_mode,
        threshold=args.threshold,
        max_error=getattr(args, "max_error", None),
        verify_ratio=getattr(args, "verify_ratio", None),
        device=engine.model.device,
        model=engine.model if args.reuse == "semantic" else None,
        tokenizer=engine.tokenizer,
    )


def describe_reuse(gen: Any) -> str:
    """The ``| reuse ...`` part of generate's stderr line: hit/miss, reused tokens, similarity."""
    info = gen.info.get("reuse", {})
    kind = info.get("kind", "miss")
    text = f" | reuse {'miss' if kind == 'miss' else kind + ' hit'}: {gen.reused_tokens}/{gen.prompt_tokens} tok"
    if info.get("compressed"):
        text += (
            f" (reused the compressed document: {info.get('press')} ratio {info.get('compression_ratio')}, quant "
            f"{info.get('quant')}, {info.get('kept_entries')} entries, {info.get('bytes_loaded')} bytes loaded in "
            f"{info.get('load_s', 0.0):.3f}s)"
        )
    elif kind == "miss" and info.get("document_key"):
        text += " (compressed document stored for later questions)"
    if info.get("approximate"):
        text += f" (approximate, similarity {info.get('similarity', 0):.3f})"
    return text
