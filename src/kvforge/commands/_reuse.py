"""``--reuse`` for ``kvforge generate``: check the options and the store, build the strategy, describe what it did."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from kvforge.commands._common import check_store_url
from kvforge.errors import STORES_DOCUMENTS, UserError, check_combination

if TYPE_CHECKING:
    from kvforge.engine import Engine


def check_reuse_args(args: argparse.Namespace) -> Any:
    """Check ``--reuse`` and its options and open its store (an unreachable server fails here, before the model
    loads); returns the store."""
    from kvforge.store import default_store_url, open_store

    if args.reuse == "rag":
        raise UserError("--reuse rag answers a question over document chunks: use `kvforge rag`")
    check_combination(press=bool(getattr(args, "press", None)), stores_documents=args.reuse in STORES_DOCUMENTS,
                      query_aware=not getattr(args, "query_agnostic", False),
                      has_document=bool(getattr(args, "prompt_file", None) and getattr(args, "prompt", None)),
                      window=bool(getattr(args, "window", None)),
                      decoding_budget=getattr(args, "decode_budget", None) is not None)  # fmt: skip
    check_semantic_args(args)
    check_store_url(args.store)
    return open_store(args.store or default_store_url())


def add_semantic_args(p: Any) -> None:
    """Semantic reuse's policy options (``kvforge generate`` and ``kvforge serve``)."""
    p.add_argument(
        "--max-error",
        type=float,
        default=None,
        help="semantic reuse: the tolerated share of wrong "
        "candidates served (default 0.01; the threshold is learned per entry, docs/reuse.md)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="semantic reuse: a fixed minimum cosine similarity instead of --max-error",
    )
    p.add_argument(
        "--verify-ratio",
        type=float,
        default=None,
        help="semantic reuse: share of lookups also answered "
        "the other way after the answer, to learn from (default 0.05; 0 = never)",
    )


def check_semantic_args(args: argparse.Namespace) -> None:
    """``--threshold``, ``--max-error`` and ``--verify-ratio`` in range and not in conflict, before any heavy import
    (:class:`kvforge.reuse.SemanticReuse` checks the same when built)."""
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
        max_error=getattr(args, "max_error", None),
        verify_ratio=getattr(args, "verify_ratio", None),
        device=engine.model.device,
    )


def describe_reuse(gen: Any) -> str:
    """The ``| reuse ...`` part of generate's stderr line: hit/miss, reused tokens, similarity."""
    from kvforge.types import ReuseFacts

    facts = gen.reuse or ReuseFacts()
    kind, doc = facts.kind, facts.document
    text = f" | reuse {'miss' if kind == 'miss' else kind + ' hit'}: {gen.reused_tokens}/{gen.prompt_tokens} tok"
    if doc is not None and doc.compressed:
        text += (
            f" (reused the compressed document: {doc.press} ratio {doc.compression_ratio}, quant {doc.quant}, "
            f"{doc.kept_entries} entries, {doc.bytes_loaded} bytes loaded in {doc.load_s:.3f}s)"
        )
    elif kind == "miss" and facts.document_key:
        text += " (compressed document stored for later questions)"
    if facts.approximate:
        text += f" (approximate, similarity {facts.similarity or 0:.3f})"
    return text
