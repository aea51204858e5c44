"""``kvforge presses``: list the compression methods selectable with ``--press``; ``kvforge presses train``: train a
learned scorer (KVzap) for a model."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from kvforge.commands._common import add_model_args, positive_int
from kvforge.errors import UserError


def register(sub: Any, bench_sub: Any) -> None:
    p = sub.add_parser("presses", help="list KV cache compression methods (--press NAME); `presses train`: KVzap",
                       epilog="Options: NAME:key=value[:key=value] (e.g. kvzip:pool=3) wherever a press is named "
                       "(--press, --methods); --options NAME lists them.")  # fmt: skip
    p.add_argument("--options", metavar="NAME", help="list the options of press NAME (set as NAME:key=value)")
    p.set_defaults(func=run_presses, check=_check_presses)
    actions = p.add_subparsers(dest="presses_command")
    t = actions.add_parser("train", help="train the learned KVzap scorer of a model on its own KVzip+ replay scores")
    add_model_args(t)
    t.add_argument("--kind", choices=("linear", "mlp"), default="linear", help="per-layer model")
    t.add_argument("--data", type=Path, action="append", help="training text: .txt files or .jsonl with a text or "
                   "context field (repeatable; default: the public-domain sample shipped with kvforge)")  # fmt: skip
    t.add_argument("--window", type=positive_int, help="tokens per training document (default: 4096)")
    t.add_argument("--max-windows", type=positive_int, help="use at most this many documents (the last is held out)")
    t.add_argument("--epochs", type=positive_int, default=30, help="MLP training epochs")
    t.add_argument("--out", type=Path, help="write the model here (default: the kvforge cache dir, where the kvzap "
                   "presses find it for this model)")  # fmt: skip
    t.add_argument("--force", action="store_true", help="train again even if this model has a trained scorer")
    t.set_defaults(func=run_train, check=_check_train)


def _check_presses(args: argparse.Namespace) -> None:
    if getattr(args, "options", None):
        from kvforge.names import check_press

        check_press(args.options)


def run_presses(args: argparse.Namespace) -> int:
    from kvforge.presses import DESCRIPTIONS, PRESSES, press_options

    if getattr(args, "options", None):
        for key, (default, owner) in press_options(args.options).items():
            print(f"{key:<16} {default!r:<24} {owner}")
        return 0
    for name, build in PRESSES.items():
        print(f"{name:<24} {build(0.5).name:<26} {DESCRIPTIONS[name]}")
    return 0


def _check_train(args: argparse.Namespace) -> None:
    for path in args.data or []:
        if not path.is_file():
            raise UserError(f"training text not found: {path}")


def run_train(args: argparse.Namespace) -> int:
    from kvforge.commands._common import load
    from kvforge.kvzap_train import DEFAULT_WINDOW, train_kvzap
    from kvforge.presses.kvzap import model_path
    from kvforge.presses.kvzip_heads import fingerprint_of

    model, tokenizer = load(args)
    out = args.out if args.out is not None else model_path(fingerprint_of(model, tokenizer), args.kind)
    if out.exists() and not args.force:
        print(f"{out} exists (trained for this model); --force trains again", file=sys.stderr)
        return 0
    start = time.perf_counter()
    trained = train_kvzap(model, tokenizer, kind=args.kind, files=args.data, window=args.window or DEFAULT_WINDOW,
                          max_windows=args.max_windows, epochs=args.epochs, progress="replay")  # fmt: skip
    trained.save(out)
    info = trained.info
    linear_out = model_path(fingerprint_of(model, tokenizer), "linear")
    if args.kind == "mlp" and args.out is None and (args.force or not linear_out.exists()):
        trained.linear.save(linear_out)  # the same replays fit the linear model: kept for `--press kvzap`
        print(f"saved the linear model fitted on the same data: {linear_out} ({trained.linear.info['validation']})")
    print(f"trained a {args.kind} KVzap scorer on {info['train_tokens']} tokens ({info['windows']} documents) in "
          f"{time.perf_counter() - start:.0f} s; held-out document: {info['validation']}")  # fmt: skip
    print(f"saved {out} ({out.stat().st_size / 1e3:.0f} kB)")
    return 0
