"""``kvforge cache ls|stats|clear|calibrate --store URL``: look into and empty a KV store; calibrate the transform
code (``kvtc``) its writers share for a model."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from kvforge.paths import default_store_url
from kvforge.redact import redact_url

STORE_ENV = "KVFORGE_STORE"


def _human(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "?"
    size = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def _press_name(press: Any) -> str:
    if not press:
        return "-"
    if isinstance(press, dict):
        name = str(press.get("name", "?"))
        ratio = press.get("compression_ratio")
        return f"{name}({ratio})" if ratio is not None else name
    return str(press)


def run_ls(args: argparse.Namespace) -> int:
    from kvforge.store import open_store

    store = open_store(args.store)
    rows = []
    keys = store.keys()
    for key in keys:
        info = store.describe(key)  # type: ignore[attr-defined]
        if info is None:
            continue
        if args.json:
            print(json.dumps({"key": key, **info}))
            continue
        rows.append(
            (
                key,
                str(info.get("num_tokens")),
                _human(info.get("stored_bytes")),
                str(info.get("model_id") or "-")[:12],
                _press_name(info.get("press")),
                info.get("quant") or "-",
            )
        )
    if not args.json:
        header = ("KEY", "TOKENS", "BYTES", "MODEL", "PRESS", "QUANT")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def run_stats(args: argparse.Namespace) -> int:
    from kvforge.store import open_store

    store = open_store(args.store)
    print(json.dumps(store.stats(deep=not args.fast), indent=2))  # type: ignore[call-arg]
    return 0


def run_clear(args: argparse.Namespace) -> int:
    """Clear the store and say what was really removed; entries that could not be: listed on stderr, exit 1."""
    import sys
    from collections import Counter

    from kvforge.store import open_store

    store = open_store(args.store)
    result = store.clear()
    shown = redact_url(args.store)
    print(f"cleared {result.removed} entries from {shown}")
    if not result.failed:
        return 0
    why = "; ".join(f"{reason}: {n}" for reason, n in Counter(result.failed.values()).most_common())
    keys = sorted(result.failed)
    listed = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    print(f"kvforge: error: could not delete {len(keys)} entries from {shown} ({why}): {listed}", file=sys.stderr)
    return 1


def run_calibrate(args: argparse.Namespace) -> int:
    """Fit the model's KV basis on the bundled sample text and make it the one every writer of the store codes
    with (kvforge's engine and vLLM's connector alike)."""
    from kvforge.calibrate import calibrate_basis
    from kvforge.commands._common import check_store_url, load
    from kvforge.model import model_fingerprint
    from kvforge.store import open_store
    from kvforge.store.transform import BOOK, publish_basis

    check_store_url(args.store)
    store = open_store(args.store)
    model, tokenizer = load(args)
    model_id = model_fingerprint(model, tokenizer)
    basis = BOOK.add(calibrate_basis(model, tokenizer))
    publish_basis(store, basis)
    print(f"KV basis {basis.digest} of {model_id} stored in {redact_url(args.store)}: kvtc entries of this model "
          "written to this store are coded with it")  # fmt: skip
    return 0


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvforge cache {ls,stats,clear}``."""
    cache = subparsers.add_parser("cache", help="list, summarise or clear a KV store")
    sub = cache.add_subparsers(dest="cache_command", required=True)
    default = os.environ.get(STORE_ENV) or default_store_url()
    help_store = (
        f"store URL: memory://, file:///path, redis://host:port/db, or a comma-separated list for tiers "
        f"(default ${STORE_ENV} or {redact_url(default)})"
    )
    for name, func, help_text in (
        ("ls", run_ls, "one line per stored segment: key, tokens, bytes, model, press"),
        ("stats", run_stats, "JSON: entries, bytes, capacity, hits, tiers, stored vs full"),
        ("clear", run_clear, "remove every segment and blob of the store"),
        ("calibrate", run_calibrate, "fit a model's KV basis (kvtc codes) once, shared by every writer of the store"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--store", default=default, help=help_store)
        if name == "calibrate":
            from kvforge.commands._common import add_model_args

            add_model_args(p)
        if name == "ls":
            p.add_argument("--json", action="store_true", help="one JSON object per line")
        if name == "stats":
            p.add_argument(
                "--fast",
                action="store_true",
                help="skip reading the entries' headers (no per-model counts, tokens or uncompressed bytes)",
            )
        p.set_defaults(func=func)
