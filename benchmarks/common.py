"""What the benchmark scripts share: where result rows go (one ``results/`` folder at the repository's root, one
sub-folder per topic)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def append_rows(path: str | Path, rows: list[dict[str, Any]] | dict[str, Any]) -> None:
    """Append JSON lines (one row or a list) to ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in [rows] if isinstance(rows, dict) else rows:
            f.write(json.dumps(row) + "\n")
