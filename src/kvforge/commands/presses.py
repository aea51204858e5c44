"""``kvforge presses``: list the compression methods selectable with ``--press``."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any, bench_sub: Any) -> None:
    p = sub.add_parser("presses", help="list KV cache compression methods (--press NAME)")
    p.set_defaults(func=run_presses)


def run_presses(args: argparse.Namespace) -> int:
    from kvforge.presses import DESCRIPTIONS, PRESSES

    for name, build in PRESSES.items():
        print(f"{name:<24} {build(0.5).name:<26} {DESCRIPTIONS[name]}")
    return 0
