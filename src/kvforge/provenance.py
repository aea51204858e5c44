"""What produced a result: kvforge's version and git commit, the library versions, the Python and the machine.

Recorded in ``run.json`` of ``kvforge eval`` and in benchmark rows, so a number can be traced to the code that made it.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

from kvforge import __version__


def git_sha(short: bool = True) -> str:
    """The commit of the kvforge source tree this module runs from (``+dirty`` with uncommitted changes to tracked
    files); ``""`` when kvforge is not run from a git checkout."""
    here = str(Path(__file__).resolve().parent)
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", *(["--short"] if short else []), "HEAD"],
                             capture_output=True, text=True, timeout=5).stdout.strip()  # fmt: skip
        if not sha:
            return ""
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return sha + ("+dirty" if dirty else "")


def versions() -> dict[str, Any]:
    """kvforge's version and commit, torch, transformers, Python, platform."""
    import torch
    import transformers

    return {
        "kvforge": __version__,
        "git_sha": git_sha(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
