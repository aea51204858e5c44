"""What every task builder shares: its configuration, a length measure (tokens or characters) and helpers."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.errors import UserError
from kvforge.eval.data import Example


@dataclass
class TaskConfig:
    """Options shared by the task builders.

    Lengths count tokens of ``tokenizer`` when one is given, else characters (the runner always passes the model's
    tokenizer, so needle lengths and depths are in model tokens there).
    """

    data_dir: Path
    tokenizer: Any | None = None
    seed: int = 0
    lengths: tuple[int, ...] = (1024, 2048, 4096)  # needle / RULER context sizes
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)  # needle depths in [0, 1]
    num_samples: int = 1  # per (length, depth) cell
    haystack: tuple[Path, ...] | None = None  # text or JSONL ({"text": ...}) files; default data_dir/haystack_*
    max_context_size: int | None = None  # converted sets: cut the middle of longer contexts (as LongBench does)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths must lie in [0, 1], got {self.depths}")
        if any(n < 16 for n in self.lengths):
            raise ValueError(f"lengths must be >= 16, got {self.lengths}")
        if self.num_samples < 1:
            raise ValueError("num_samples must be >= 1")

    def rng(self, *salt: object) -> random.Random:
        """A generator seeded by the config seed and ``salt`` (stable across runs and Python versions)."""
        return random.Random(f"{self.seed}:" + ":".join(map(str, salt)))


class Measure:
    """Length in tokens of a tokenizer (no special tokens), or in characters without one."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    @property
    def unit(self) -> str:
        return "tokens" if self.tokenizer is not None else "characters"

    def size(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """Character span of every unit of ``text`` (a fast tokenizer's offset mapping)."""
        if self.tokenizer is None:
            return [(i, i + 1) for i in range(len(text))]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [tuple(span) for span in enc["offset_mapping"]]

    def prefix_chars(self, text: str, size: int) -> int:
        """The number of characters of ``text`` covered by its first ``size`` units."""
        if size <= 0:
            return 0
        if self.tokenizer is None:
            return min(size, len(text))
        spans = self.offsets(text[: size * 16 + 64])
        return spans[min(size, len(spans)) - 1][1] if spans else 0

    def head(self, text: str, size: int) -> str:
        """The longest prefix of ``text`` at most ``size`` units long (cut on a unit boundary)."""
        return text[: self.prefix_chars(text, size)]


def truncate_middle(text: str, max_size: int | None, measure: Measure) -> str:
    """Keep the first and last ``max_size / 2`` units of a longer text (LongBench's truncation).

    Head and tail are tokenized separately (a long document is never tokenized whole), so the seam may differ from
    a full tokenization by a token.
    """
    if max_size is None or len(text) <= max_size:
        return text
    half, tail_size = max_size // 2, max_size - max_size // 2
    head_end = measure.prefix_chars(text, half)
    window = min(len(text), tail_size * 16 + 64)
    spans = measure.offsets(text[len(text) - window :])
    tail_start = len(text) - window + spans[max(0, len(spans) - tail_size)][0] if spans else len(text)
    if head_end >= tail_start:
        return text
    return text[:head_end] + text[tail_start:]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a data JSONL file, with a clear error when the shared data is missing."""
    if not path.is_file():
        raise UserError(f"data file {path} not found (set --data-dir or $KVFORGE_DATA_DIR to the shared data folder)")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def interleave(groups: Sequence[Iterable[Example]]) -> list[Example]:
    """Round-robin merge, so that ``--limit N`` takes a mix of every group.

    An example whose id came earlier is dropped (``ruler``'s single needles are the ``needle`` task's), so ``--limit``
    counts distinct examples.
    """
    lists = [list(g) for g in groups]
    out: list[Example] = []
    seen: set[str] = set()
    for i in range(max((len(g) for g in lists), default=0)):
        for g in lists:
            if i < len(g) and g[i].id not in seen:
                seen.add(g[i].id)
                out.append(g[i])
    return out
