"""Assemble stored chunk KV into one cache at new positions, and recompute selected tokens on top of it.

Token order is the prompt's: ``prefix + c_1 + sep + ... + c_n + sep + question``. The prefix is placed once,
every chunk's keys are re-rotated from their stored positions to their new offsets, separators and the question
are never cached (always computed fresh). Recomputation runs the selected tokens through the model at their true
positions over a cache holding everyone else's entries: kvforge attention masks by position, so every selected
token attends exactly to the entries at positions <= its own (an exact position-causal mask): that run is
:func:`kvforge.prefill.prefill_at`, executed by ``Engine`` from a :class:`kvforge.reuse.rag.ChunkPlan`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from kvforge.cache import HIDDEN, KVCache, Reserved
from kvforge.reuse.rag.chunks import ChunkCache
from kvforge.reuse.rag.prompt import RagPrompt
from kvforge.rope import RopeSpec
from kvforge.types import KVSegment


class ChunkSource(Protocol):
    """What RAG methods and the auxiliary scorer use of a chunk reuse strategy (:class:`ChunkReuse` is one)."""

    model: Any
    tokenizer: Any
    chunks: ChunkCache

    @property
    def num_layers(self) -> int: ...

    def load(self, prompt: RagPrompt, ape: bool = False) -> Assembly: ...


@dataclass
class Assembly:
    """The prompt's tokens with the reused KV of its cached ones (prefix + chunks), at their new positions.

    ``keys[l]``/``values[l]`` are ``(H_kv, S_c, D)`` for the cached tokens ``cached_idx`` ``(S_c,)`` (indices into
    ``ids``), in prompt order. ``positions`` ``(N,)`` are the RoPE positions of all N tokens; ``is_context``
    ``(N,)`` marks chunk tokens, ``is_cached`` ``(N,)`` prefix + chunk tokens.
    """

    ids: Tensor
    positions: Tensor
    is_context: Tensor
    is_cached: Tensor
    cached_idx: Tensor
    keys: list[Tensor]
    values: list[Tensor]
    prefix_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())

    @property
    def fresh_idx(self) -> Tensor:
        """Indices of the tokens that have no reused KV (separators, question): always computed."""
        return (~self.is_cached).nonzero().flatten()

    @property
    def context_idx(self) -> Tensor:
        return self.is_context.nonzero().flatten()


def assemble(
    prompt: RagPrompt, prefix: KVSegment | None, chunks: list[KVSegment], rope: RopeSpec | None, *, ape: bool = False
) -> Assembly:
    """Place the prefix once and the chunks after it with continuous positions (keys re-rotated).

    With ``ape=True`` every chunk keeps its stored positions ``P..P+L_i-1`` (APE's position reuse), inter-chunk
    separators are dropped and the final separator + question start at ``P + max L_i``.
    """
    p = len(prompt.prefix_ids)
    ids: list[int] = list(prompt.prefix_ids)
    pos: list[int] = list(range(p))
    ctx: list[bool] = [False] * p
    cached: list[bool] = [True] * p
    keys: list[list[Tensor]] = [[] if prefix is None else [prefix.keys[i]] for i in range(len(chunks[0].keys))]
    values: list[list[Tensor]] = [[] if prefix is None else [prefix.values[i]] for i in range(len(keys))]
    cursor = p  # position of the next placed token
    max_len = max(len(c) for c in prompt.chunk_ids)
    deltas: list[Tensor] = [torch.zeros(p, dtype=torch.long)]  # how far each cached entry moves (the prefix stays)

    def place(piece: list[int], is_ctx: bool, is_cached: bool) -> None:
        nonlocal cursor
        ids.extend(piece)
        pos.extend(range(cursor, cursor + len(piece)))
        ctx.extend([is_ctx] * len(piece))
        cached.extend([is_cached] * len(piece))
        cursor += len(piece)

    for i, (chunk_ids, seg) in enumerate(zip(prompt.chunk_ids, chunks, strict=True)):
        if seg.token_ids != chunk_ids:
            raise ValueError(f"chunk {i}: stored segment holds other tokens")
        if ape:
            cursor = p  # position reuse: every chunk at P..P+L_i-1
        first = _stored_start(seg, i, len(chunk_ids))
        if cursor != first and rope is None:
            raise ValueError("moving chunks needs the model's RoPE spec")
        deltas.append(torch.full((len(chunk_ids),), cursor - first, dtype=torch.long))
        for li in range(len(keys)):
            keys[li].append(seg.keys[li])
            values[li].append(seg.values[li])
        place(chunk_ids, True, True)
        if ape and i < len(chunks) - 1:
            continue  # APE: contexts are parallel, there is no "between" them
        if ape:
            cursor = p + max_len
        place(prompt.sep_ids, False, False)
    place(prompt.question_ids, False, False)
    is_cached = torch.tensor(cached)
    joined = [torch.cat(k, dim=1) for k in keys]  # (H_kv, S_c, D) per layer, stored positions
    if rope is not None:  # one rotation per layer for every chunk (each entry by its chunk's delta)
        joined = rope.rotate_layers(joined, torch.cat(deltas))
    return Assembly(
        ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        is_context=torch.tensor(ctx),
        is_cached=is_cached,
        cached_idx=is_cached.nonzero().flatten(),
        keys=joined,
        values=[torch.cat(v, dim=1) for v in values],
        prefix_len=p,
    )


def _stored_start(seg: KVSegment, index: int, num_tokens: int) -> int:
    """The first stored position of chunk ``index``, checking that every layer holds ``num_tokens`` contiguous ones."""
    first = int(seg.positions[0][0, 0])
    run = torch.arange(first, first + num_tokens)
    for li, stored in enumerate(seg.positions):
        row = stored[0]  # (L,) same for every head
        if row.numel() != num_tokens or not torch.equal(row.cpu(), run):
            raise ValueError(f"chunk {index}, layer {li}: stored positions are not {num_tokens} contiguous ones")
    return first


def build_cache(
    model: Any,
    asm: Assembly,
    recompute: Tensor,
    overrides: dict[int, tuple[Tensor, Tensor]] | None = None,
    num_layers: int | None = None,
) -> KVCache:
    """A cache holding every prompt token in prompt order: the reused entries of the cached tokens not in
    ``recompute`` ``(N,)`` bool, and reserved slots (:class:`~kvforge.cache.Reserved`, at position
    :data:`~kvforge.cache.HIDDEN` until written) for the tokens the plan runs: recomputed, separators, question.
    :func:`kvforge.prefill.prefill_at` of exactly those tokens fills them in place (no entry moves, no sort).

    ``overrides[l] = (keys, values)`` ``(H_kv, S_c, D)`` replaces layer l's reused KV (CacheBlend's fresh layers);
    ``num_layers``: fill only the first layers (CacheBlend's early pass runs no others).
    """
    run = recompute | ~asm.is_cached  # (N,)
    kept = ~recompute[asm.cached_idx]  # (S_c,) cached entries reused
    slots = asm.cached_idx[kept]  # where they go
    every = bool(kept.all())
    positions = asm.positions.masked_fill(run, HIDDEN)
    device = next(model.parameters()).device
    cache = KVCache.for_model(model)
    n = asm.num_tokens
    at, kept_at = slots.to(asm.keys[0].device), kept.to(asm.keys[0].device)  # index_copy_: index beside the entries
    for li, layer in enumerate(cache.layers[:num_layers]):
        k, v = overrides[li] if overrides and li in overrides else (asm.keys[li], asm.values[li])
        keys, values = k.new_zeros((1, k.shape[0], n, k.shape[2])), v.new_zeros((1, v.shape[0], n, v.shape[2]))
        keys[0].index_copy_(1, at, k if every else k[:, kept_at])
        values[0].index_copy_(1, at, v if every else v[:, kept_at])
        layer.replace(keys.to(device), values.to(device), positions[None].to(device))
    cache.reserved = Reserved(
        slots=run.nonzero().flatten(),
        positions=asm.positions[run],
        in_order=bool((asm.positions[1:] >= asm.positions[:-1]).all()),
        strict=bool((asm.positions[1:] > asm.positions[:-1]).all()),
    )
    kept_positions = asm.positions[~run]
    cache.next_position = int(kept_positions.max()) + 1 if kept_positions.numel() else 0
    cache.token_ids = []  # tokens in prompt order are set once the plan's recomputation ran
    return cache


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder layer list of an HF causal LM (``model.model.layers``)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


@contextmanager
def truncated(model: Any, num_layers: int) -> Iterator[None]:
    """Run only the first ``num_layers`` decoder layers inside the block (CacheBlend's full early layers)."""
    base = model.model
    layers = decoder_layers(model)
    base.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    try:
        yield
    finally:
        base.layers = layers
