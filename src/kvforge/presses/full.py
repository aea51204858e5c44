"""FullPress: keeps every entry (the uncompressed baseline, selectable by name like any press)."""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.presses.base import Press
from kvforge.presses.layer import LayerContext, Selection


@dataclass
class FullPress(Press):
    """Keep everything; ``compression_ratio`` is accepted for a uniform CLI but always reported as 0."""

    compression_ratio: float = 0.0

    def ratio(self) -> float:
        return 0.0

    def compress(self, ctx: LayerContext) -> Selection:
        return Selection.everything(ctx)
