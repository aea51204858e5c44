"""Continuous batching: one forward per step for many sequences, each on its own :class:`KVCache`.

A step's forward packs every row's tokens into one sequence: the next token of each decoding sequence and, beside
them, prompt chunks being prefilled (chunked prefill mixed with decoding, as vLLM and SGLang schedule it). The
model's linear layers and MLP run on all packed tokens at once (on a small model that is where a step's time goes:
reading the weights, which a lone decode row pays for one token); inside attention each row attends to its own cache
(its length, positions, compression, per-head validity, window), through exactly the code a single-sequence forward
runs. So a sequence gets the same logits, and greedy tokens, batched or alone, whatever else shares its step.
Sequences join and leave at any step: a step's batch is just the rows handed to :func:`forward_packed`
(:meth:`kvforge.engine.Engine.step` builds them).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

import torch
from torch import Tensor

from kvforge.attention import kvforge_attention
from kvforge.cache import KVCache
from kvforge.prefill import call_model

__all__ = ["BatchedCache", "forward_batch", "forward_packed"]


class BatchedCache:
    """The model-facing cache of a packed forward: tokens ``[offsets[i], offsets[i + 1])`` belong to ``caches[i]``.

    ``update`` appends each row's new keys/values to its own cache; :func:`kvforge.attention.kvforge_attention` sees
    :meth:`attend_rows` and runs each row's attention on its own cache (masks from its own positions).
    """

    def __init__(self, caches: Seq[KVCache], sizes: Seq[int] | None = None) -> None:
        self.caches = list(caches)
        sizes = [1] * len(self.caches) if sizes is None else list(sizes)
        self.offsets = [0, *itertools.accumulate(sizes)]
        self._rows: dict[int, list[tuple[Tensor, Tensor]]] = {}  # layer -> each row's (keys, values) after update

    def _spans(self) -> list[tuple[int, int]]:
        return list(itertools.pairwise(self.offsets))

    # transformers' Cache interface (what decoder layers call)
    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Append each row's new keys/values to its own cache (extra arguments: whatever the release passes)."""
        self._rows[layer_idx] = [  # key_states (1, H_kv, S_total, D)
            cache.update(key_states[:, :, a:b], value_states[:, :, a:b], layer_idx)
            for cache, (a, b) in zip(self.caches, self._spans(), strict=True)
        ]
        return key_states, value_states  # attention reads each row's own entries (attend_rows), not these

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(cache.next_position for cache in self.caches)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def attend_rows(self, module: Any, query: Tensor, **kwargs: Any) -> Tensor:
        """Each row's queries ``(1, H, s_i, D)`` against its own cache; returns ``(1, S_total, H, D)``."""
        rows = self._rows[module.layer_idx]
        outs = [
            kvforge_attention(module, query[:, :, a:b], keys, values, None, kv_cache=cache, **kwargs)[0]
            for cache, (keys, values), (a, b) in zip(self.caches, rows, self._spans(), strict=True)
        ]
        return torch.cat(outs, dim=1)


@torch.inference_mode()
def forward_packed(model: Any, chunks: Seq[Seq[int]], caches: Seq[KVCache]) -> Tensor:
    """One forward of ``chunks[i]`` on top of ``caches[i]`` for every row, all rows packed into one sequence; returns
    the logits of each chunk's last token ``(N, V)``.

    Each chunk continues at its cache's next position. On an error every cache is rolled back (all stay usable).
    """
    if len(chunks) != len(caches) or not caches:
        raise ValueError(f"need one chunk per cache, got {len(chunks)} chunks for {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("a cache appears twice in one batch")
    if any(len(chunk) == 0 for chunk in chunks):
        raise ValueError("every chunk needs at least one token")
    device = model.device
    sizes = [len(chunk) for chunk in chunks]
    ids = torch.tensor([[int(t) for chunk in chunks for t in chunk]], dtype=torch.long, device=device)  # (1, S)
    starts = [cache.next_position for cache in caches]
    positions = torch.tensor(
        [[p for start, n in zip(starts, sizes, strict=True) for p in range(start, start + n)]],
        dtype=torch.long,
        device=device,
    )  # (1, S)
    view = BatchedCache(caches, sizes)
    spans = view._spans()
    for cache, (a, b) in zip(caches, spans, strict=True):
        cache.begin(positions[:, a:b])
    last = torch.tensor([b - 1 for _, b in spans], dtype=torch.long, device=device)
    try:
        out = call_model(model, ids, positions, view, logits_to_keep=last)  # type: ignore[arg-type]
    except BaseException:
        for cache in caches:
            cache.abort()
        raise
    for cache, (a, b) in zip(caches, spans, strict=True):
        cache.end(ids[:, a:b])
    return out.logits[0]  # type: ignore[no-any-return]


def forward_batch(model: Any, token_ids: Seq[int], caches: Seq[KVCache]) -> Tensor:
    """One decode forward: token ``token_ids[i]`` on top of ``caches[i]`` for every row; returns logits ``(B, V)``."""
    if len(token_ids) != len(caches):
        raise ValueError(f"need one token per cache, got {len(token_ids)} tokens for {len(caches)} caches")
    return forward_packed(model, [[t] for t in token_ids], caches)
