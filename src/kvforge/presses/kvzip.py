"""KVzip (Kim et al., 2025, arXiv 2505.23416): score entries by how much the model needs them to repeat the context.

After the context is prefilled, a prompt asking to repeat it plus the context itself are teacher-forced on top of
the cache (chunk by chunk); every context entry's score is the max attention it receives from those queries (max
over the queries and the query heads of its GQA group). The reconstruction entries are removed afterwards, so the
cost is one extra prefill of the context, paid once per document: the right trade for a query-agnostic cache that
is stored and reused for many questions.

Departure: per-layer, per-head uniform budgets (like every press here, so ratios compare); the paper ranks entries
across all heads and layers at once. Wrap it in :class:`~kvforge.presses.adakv.AdaKVPress` for head-adaptive budgets.
Without a tokenizer (``compress_prefill(..., tokenizer=None)`` and no ``prompt_ids``) only the context is repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from kvforge.presses.base import LayerContext, Needs, ScorerPress

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"


@dataclass
class KVzipPress(ScorerPress):
    """Context-reconstruction scoring; per-head top-k on the max attention received while repeating the context."""

    prompt: str = REPEAT_PROMPT
    prompt_ids: list[int] | None = field(default=None, repr=False)

    def needs(self) -> Needs:
        return Needs(reconstruction=True)

    def score(self, ctx: LayerContext) -> Tensor:
        if ctx.reconstruction_scores is None:
            raise ValueError("KVzip needs reconstruction scores (run it through compress_prefill)")
        return ctx.group_reduce(ctx.reconstruction_scores, "max")
