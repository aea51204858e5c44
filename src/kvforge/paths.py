"""Where things live: the shared evaluation data and kvforge's user cache folder."""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "KVFORGE_DATA_DIR"
CACHE_ENV = "KVFORGE_CACHE_DIR"


def default_data_dir() -> Path:
    """The evaluation data folder: ``$KVFORGE_DATA_DIR``, else the first ``shared/data`` found walking up from
    the current directory (a checkout sits beside ``shared/``), else ``../shared/data``."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env)
    for base in [Path.cwd(), *Path.cwd().parents]:
        for candidate in (base / "shared" / "data", base.parent / "shared" / "data"):
            if candidate.is_dir():
                return candidate
    return Path("..") / "shared" / "data"


def cache_dir() -> Path:
    """kvforge's user cache folder (dequantized model weights, default disk store): ``$KVFORGE_CACHE_DIR`` or
    ``$XDG_CACHE_HOME/kvforge`` or ``~/.cache/kvforge``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvforge"
