"""``--reuse`` for ``kvforge generate``: check the options and the store, build the strategy, describe what it did."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from kvforge.commands._common import check_store_url
from kvforge.errors import PRESS_WITH_REUSE, UserError

if TYPE_CHECKING:
    from kvforge.engine import Engine


def check_reuse_args(args: argparse.Namespace) -> Any:
    """Check ``--reuse`` and its options and open its store (an unreachable server fails here, before the model
    loads); returns the store."""
    from kvforge.store import default_store_url, open_store

    if args.reuse == "rag":
        raise UserError("--reuse rag answers a question over document chunks: use `kvforge rag`")
    if getattr(args, "press", None):  # the compressed document is stored and reused: query-agnostic, document reuse
        document = getattr(args, "prompt_file", None) and getattr(args, "prompt", None)
        if args.reuse not in ("prefix", "document") or not getattr(args, "query_agnostic", False) or not document:
            raise UserError(PRESS_WITH_REUSE)
    if getattr(args, "window", None):
        raise UserError("--reuse cannot be combined with --window")
    if args.threshold is not None and not -1 <= args.threshold <= 1:
        raise UserError(f"--threshold is a cosine similarity in [-1, 1], got {args.threshold}")
    check_store_url(args.store)
    return open_store(args.store or default_store_url())


def attach_reuse(engine: Engine, args: argparse.Namespace, store: Any = None) -> None:
    """Give ``engine`` the reuse strategy named by ``--reuse`` over the store of ``--store`` (or ``store``); with a
    press, ``prefix`` means the compressed document (document reuse)."""
    from kvforge.reuse import build_reuse

    if store is None:
        store = check_reuse_args(args)
    engine.reuse = build_reuse(
        "document" if getattr(args, "press", None) else args.reuse,
        store,
        engine.model_id,
        semantic_mode=args.semantic_mode,
        threshold=args.threshold,
        device=engine.model.device,
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
