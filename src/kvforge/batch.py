"""Continuous batching: one forward per decode step for many sequences, each on its own :class:`KVCache`.

The model's linear layers and MLP run on all B rows at once (on a small model that is where a step's time goes:
reading the weights); inside attention each row attends to its own cache (its length, positions, compression,
per-head validity, window), through exactly the code a single-sequence forward runs. So a sequence gets the same
logits, and greedy tokens, batched or alone, whatever else shares its step. Sequences join and leave at any step:
a batch is just the list handed to :func:`decode_step`.

    states = [DecodeState(32, eos_token_ids=eos) for _ in prompts]
    running = [Sequence(cache, logits, state) for (cache, logits), state in zip(prefilled, states)]
    while running:
        running = decode_step(model, running)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvforge.attention import kvforge_attention
from kvforge.cache import KVCache
from kvforge.decode import DecodeState
from kvforge.prefill import call_model

__all__ = ["BatchedCache", "Sequence", "decode_step", "forward_batch"]


class BatchedCache:
    """The model-facing cache of a batched decode forward: row ``i`` of every tensor belongs to ``caches[i]``.

    ``update`` appends each row's new key/value to its own cache; :func:`kvforge.attention.kvforge_attention` sees
    :meth:`attend_rows` and runs each row's attention on its own cache (masks from its own positions).
    """

    def __init__(self, caches: Seq[KVCache]) -> None:
        self.caches = list(caches)
        self._rows: dict[int, list[tuple[Tensor, Tensor]]] = {}  # layer -> each row's (keys, values) after update

    # transformers' Cache interface (what decoder layers call)
    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs: dict[str, Any] | None = None
    ) -> tuple[Tensor, Tensor]:
        self._rows[layer_idx] = [
            cache.update(key_states[i : i + 1], value_states[i : i + 1], layer_idx)
            for i, cache in enumerate(self.caches)
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
        """Each row's query ``(1, H, 1, D)`` against its own cache; returns ``(B, 1, H, D)``."""
        rows = self._rows[module.layer_idx]
        outs = [
            kvforge_attention(module, query[i : i + 1], keys, values, None, kv_cache=cache, **kwargs)[0]
            for i, (cache, (keys, values)) in enumerate(zip(self.caches, rows, strict=True))
        ]
        return torch.cat(outs, dim=0)


@torch.inference_mode()
def forward_batch(model: Any, token_ids: Seq[int], caches: Seq[KVCache]) -> Tensor:
    """One decode forward: token ``token_ids[i]`` on top of ``caches[i]`` for every row; returns logits ``(B, V)``.

    Each token takes its cache's next position. On an error every cache is rolled back (all stay usable).
    """
    if len(token_ids) != len(caches) or not caches:
        raise ValueError(f"need one token per cache, got {len(token_ids)} tokens for {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("a cache appears twice in one batch")
    device = model.device
    ids = torch.tensor([[t] for t in token_ids], dtype=torch.long, device=device)  # (B, 1)
    positions = torch.tensor([[c.next_position] for c in caches], dtype=torch.long, device=device)  # (B, 1)
    for i, cache in enumerate(caches):
        cache.begin(positions[i : i + 1])
    view = BatchedCache(caches)
    try:
        out = call_model(model, ids, positions, view, logits_to_keep=1)
    except BaseException:
        for cache in caches:
            cache.abort()
        raise
    for i, cache in enumerate(caches):
        cache.end(ids[i : i + 1])
    return out.logits[:, -1]  # type: ignore[no-any-return]


@dataclass
class Sequence:
    """One running request: its cache, the logits its next token is picked from, and its :class:`DecodeState`."""

    cache: KVCache
    logits: Tensor  # (1, V)
    state: DecodeState
    tag: Any = None  # the caller's handle (the server's job)


def decode_step(model: Any, running: Seq[Sequence]) -> list[Sequence]:
    """Pick each sequence's next token, then run one forward for those that go on; returns them (the others ended).

    Per sequence this is one iteration of :func:`kvforge.decode.decode`: same picks, same stopping rules.
    """
    going: list[tuple[Sequence, int]] = []
    for seq in running:
        token = seq.state.pick(seq.logits)
        if token is not None:
            going.append((seq, token))
    if not going:
        return []
    logits = forward_batch(model, [t for _, t in going], [s.cache for s, _ in going])
    for i, (seq, _) in enumerate(going):
        seq.logits = logits[i : i + 1]
    return [s for s, _ in going]
