"""Which prompt chunks share a step's forward: the budget, reuse hits first, no starvation.

A step prefills at most ``budget`` prompt tokens beside its decode rows. Sequences with the least prompt left go
first (a reuse hit, whose plan left only its question, starts decoding at once instead of waiting behind a long new
prompt: shortest remaining work first), and the oldest prefilling sequence always gets at least a quarter of the
budget, so a long prompt progresses whatever arrives after it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvforge.sequence import Sequence

__all__ = ["schedule_chunks", "step_budget"]


def step_budget(chunk_size: int | None, prefill_budget: int | None, num_decoding: int) -> int | None:
    """Prompt tokens this step may prefill: ``chunk_size`` when nothing decodes (a lone prompt runs in the chunks a
    plain prefill uses), else ``prefill_budget`` (streams keep getting tokens between a long prompt's chunks);
    None = no limit."""
    if num_decoding == 0 or prefill_budget is None:
        return chunk_size
    return min(prefill_budget, chunk_size) if chunk_size is not None else prefill_budget


def schedule_chunks(prefilling: Seq[Sequence], budget: int | None) -> list[tuple[Sequence, int]]:
    """``(sequence, tokens)`` of this step's prompt chunks, within ``budget`` tokens, in ``prefilling``'s order
    (arrival order: the first is the oldest). Each chunk stays inside the sequence's current unit."""

    def left(seq: Sequence) -> int:
        return len(seq.units[0].ids) - seq.offset

    if not prefilling:
        return []
    if budget is None:
        return [(s, left(s)) for s in prefilling]
    oldest = prefilling[0]
    take = {id(oldest): min(left(oldest), max(1, budget // 4))}
    room = budget - take[id(oldest)]
    for seq in sorted(prefilling, key=left):  # stable: equal work keeps arrival order
        extra = min(left(seq) - take.get(id(seq), 0), room)
        if extra > 0:
            take[id(seq)] = take.get(id(seq), 0) + extra
            room -= extra
    return [(s, take[id(s)]) for s in prefilling if take.get(id(s))]
