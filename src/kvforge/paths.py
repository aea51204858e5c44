"""Where things live: the shared evaluation data, the haystack bundled with the package, kvforge's user cache."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

DATA_ENV = "KVFORGE_DATA_DIR"
CACHE_ENV = "KVFORGE_CACHE_DIR"


def default_data_dir() -> Path:
    """The evaluation data folder: ``$KVFORGE_DATA_DIR``, else the first ``shared/data`` folder found in the current
    directory, one of its parents or beside one of them; else :data:`NO_DATA_DIR` (a path that does not exist: the
    tasks then run on the samples bundled with kvforge)."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env)
    for base in [Path.cwd(), *Path.cwd().parents]:
        for candidate in (base / "shared" / "data", base.parent / "shared" / "data"):
            if candidate.is_dir():
                return candidate
    return NO_DATA_DIR


#: What :func:`default_data_dir` returns when no evaluation data folder was found.
NO_DATA_DIR = Path("kvforge-no-data-dir")


def bundled_data_dir() -> Path:
    """Data shipped inside the package (``kvforge/data``): a public-domain haystack, so the generated tasks (needle,
    needle-docs, RULER) and the TTFT benchmark run after ``pip install`` with no shared data folder."""
    return Path(__file__).resolve().parent / "data"


def haystack_files(data_dir: Path | None = None) -> list[Path]:
    """The haystack: every ``data_dir/haystack_*`` folder's ``.jsonl``/``.txt`` files (RULER's Paul Graham essays
    first); the bundled public-domain excerpt when ``data_dir`` has none (or does not exist)."""
    for base in ([Path(data_dir)] if data_dir is not None else []) + [bundled_data_dir()]:
        folders = sorted(base.glob("haystack_*"), key=lambda p: (p.name != "haystack_paul_graham", p.name))
        files = [f for d in folders if d.is_dir() for f in sorted(d.iterdir()) if f.suffix in (".jsonl", ".txt")]
        if files:
            return files
    return []


_warned: set[tuple[str, str]] = set()


def task_data_folder(data_dir: Path, folder: str) -> Path:
    """``data_dir/folder`` (a converted task's data, e.g. ``squad_v2_dev``); when the data folder has none, the small
    sample of the same layout bundled with the package (a few examples written on the public-domain haystack), with
    one warning per folder and data folder that this is a smoke-test sample and how to point at the full data."""
    path = Path(data_dir) / folder
    if path.is_dir():
        return path
    key = (str(Path(data_dir).resolve()), folder)
    if key not in _warned:
        _warned.add(key)
        where = (
            "no evaluation data folder was given or found"
            if Path(data_dir) == NO_DATA_DIR or not Path(data_dir).is_dir()
            else f"the data folder {data_dir} has no {folder}/"
        )
        logger.warning(
            "%s: using the small bundled sample of %s shipped with kvforge (a smoke test, not a benchmark). For the "
            "real benchmark, give --data-dir DIR (or set $%s) where DIR holds %s/ in the layout of kvforge's "
            "docs/eval.md",
            where, folder, DATA_ENV, folder,
        )  # fmt: skip
    return bundled_data_dir() / folder


def cache_dir() -> Path:
    """kvforge's user cache folder (dequantized model weights, default disk store): ``$KVFORGE_CACHE_DIR`` or
    ``$XDG_CACHE_HOME/kvforge`` or ``~/.cache/kvforge``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvforge"


def default_store_url() -> str:
    """The embedded default store: a disk store in kvforge's cache folder."""
    return f"file://{cache_dir() / 'kv'}"
