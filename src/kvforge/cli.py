"""The ``kvforge`` command line: ``main(argv) -> int``; subcommands live in :mod:`kvforge.commands`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvforge import __version__
from kvforge.commands import COMMAND_MODULES
from kvforge.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description="Compress, store and reuse LLM KV caches.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    parser.add_argument("--version", action="version", version=f"kvforge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="speed benchmarks (one JSON line per configuration)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (errors are one line on stderr, no traceback)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"kvforge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvforge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
