"""Where a paged KV cache keeps each key and value element, learnt from the attention backend's own writer.

A vLLM attention layer's cache is one tensor whose first dimension is the block (``[num_blocks, ...]``); what a
block holds inside depends on the backend and, on CPU, on the instruction set (AVX2 "vec" keeps each head's keys
transposed, ``[head_dim, block]``, then its values ``[block, head_dim]``; AMX packs bf16 otherwise). Nothing here
assumes one of them: :func:`probe_layout` writes known values through the backend's writer into a scratch block and
reads back where each ``(head, token, channel)`` of K and of V landed. The result turns whole blocks into
``(H_kv, S, D)`` keys and values (:meth:`BlockLayout.gather`) and back (:meth:`BlockLayout.scatter`), with plain
indexing, on any device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# write(keys (N, H_kv, D), values (N, H_kv, D), cache (1, *block_shape), slot_mapping (N,)): the backend's writer
Writer = Callable[[Tensor, Tensor, Tensor, Tensor], None]

_BASE = 16  # digits small enough to be exact in any float dtype (fp16, bf16 included)


class LayoutError(RuntimeError):
    """The backend stores K/V in a way this connector cannot address element by element (e.g. an fp8 cache)."""


@dataclass(frozen=True)
class BlockLayout:
    """Flat offsets, inside one block, of every key and value element.

    Args:
        key_index: ``(H_kv, N, D)`` int64: offset in the flattened block of key ``[h, t, d]`` (N = tokens per block).
        value_index: the same for values.
        block_shape: ``cache.shape[1:]`` of the caches this layout addresses.
    """

    key_index: Tensor
    value_index: Tensor
    block_shape: tuple[int, ...]

    @property
    def num_kv_heads(self) -> int:
        return int(self.key_index.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.key_index.shape[1])

    def _check(self, cache: Tensor) -> None:
        if tuple(cache.shape[1:]) != self.block_shape:
            shape = tuple(cache.shape[1:])
            raise LayoutError(f"cache blocks are {shape}, this layout was probed on {self.block_shape}")

    def gather(self, cache: Tensor, block_ids: Sequence[int] | Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``(H_kv, len(block_ids) * N, D)`` held by ``block_ids`` (new tensors, cache's device)."""
        self._check(cache)
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
        flat = cache.index_select(0, ids).reshape(len(ids), -1)  # (n, block elements)
        return self._unpack(flat, self.key_index), self._unpack(flat, self.value_index)

    def _unpack(self, flat: Tensor, index: Tensor) -> Tensor:
        n = flat.shape[0]
        picked = flat[:, index.to(flat.device).reshape(-1)]  # (n, H*N*D)
        h, t, d = index.shape
        return picked.view(n, h, t, d).permute(1, 0, 2, 3).reshape(h, n * t, d)

    def scatter(self, cache: Tensor, block_ids: Sequence[int] | Tensor, keys: Tensor, values: Tensor) -> None:
        """Write ``keys``/``values`` ``(H_kv, len(block_ids) * N, D)`` into ``block_ids`` (other bytes of those blocks,
        such as padding, are kept)."""
        self._check(cache)
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
        n = len(ids)
        h, t, d = self.key_index.shape
        if keys.shape != (h, n * t, d) or values.shape != keys.shape:
            raise ValueError(f"expected keys and values of shape {(h, n * t, d)}, got {tuple(keys.shape)}")
        flat = cache.index_select(0, ids).reshape(n, -1)
        for index, data in ((self.key_index, keys), (self.value_index, values)):
            rows = data.to(device=flat.device, dtype=flat.dtype).reshape(h, n, t, d).permute(1, 0, 2, 3)
            flat[:, index.to(flat.device).reshape(-1)] = rows.reshape(n, -1)
        cache.index_copy_(0, ids, flat.view(n, *self.block_shape))


def probe_layout(
    write: Writer,
    block_shape: Sequence[int],
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> BlockLayout:
    """Learn a backend's block layout by writing one block of known keys and values through ``write``.

    Each pass writes one base-16 digit of every element's number (keys positive, values negative, so both are
    exact in any float dtype) into a zeroed scratch block; the digits read back at each offset give the element
    stored there (offsets never written are padding). Raises :class:`LayoutError` when an element is missing,
    stored twice or transformed (scaled, quantised).
    """
    block_shape = tuple(int(s) for s in block_shape)
    numel = math.prod(block_shape)
    n, h, d = block_size, num_kv_heads, head_size
    if numel < 2 * n * h * d:
        raise LayoutError(f"a block of {numel} elements cannot hold K and V of {n} tokens x {h} heads x {d} channels")
    count = h * n * d
    ids = torch.arange(count, dtype=torch.long).view(h, n, d)  # element number of (h, t, d)
    passes = max(1, math.ceil(math.log(count, _BASE))) if count > 1 else 1
    decoded = torch.zeros(numel, dtype=torch.long)
    seen = torch.zeros(numel, dtype=torch.long)  # +1 for keys, -1 for values, 0 untouched
    slots = torch.arange(n, dtype=torch.long, device=device)
    for p in range(passes):
        digit = (ids // _BASE**p) % _BASE + 1  # 1..16
        keys = digit.permute(1, 0, 2).to(device=device, dtype=dtype)  # (N, H, D)
        scratch = torch.zeros((1, *block_shape), dtype=dtype, device=device)
        write(keys.contiguous(), (-keys).contiguous(), scratch, slots)
        got = scratch.reshape(-1).to("cpu", torch.float32)
        if not torch.equal(got, got.round()) or got.abs().max() > _BASE:
            raise LayoutError("the backend transforms the values it stores (a quantised or scaled KV cache?)")
        got = got.long()
        if p == 0:
            seen = got.sign()
        elif not torch.equal(got.sign(), seen):
            raise LayoutError("the backend's layout changed between two identical writes")
        decoded += (got.abs() - 1).clamp(min=0) * _BASE**p
    key_index = _invert(decoded, seen == 1, count, "key").view(h, n, d)
    value_index = _invert(decoded, seen == -1, count, "value").view(h, n, d)
    return BlockLayout(key_index=key_index, value_index=value_index, block_shape=block_shape)


def _invert(decoded: Tensor, where: Tensor, count: int, what: str) -> Tensor:
    """Offset of each element number ``0..count-1`` given the number found at each offset (``where`` holds it)."""
    offsets = where.nonzero().flatten()
    numbers = decoded[offsets]
    if offsets.numel() != count or not torch.equal(numbers.sort().values, torch.arange(count)):
        raise LayoutError(f"the backend does not store each {what} element exactly once in a block")
    index = torch.empty(count, dtype=torch.long)
    index[numbers] = offsets
    return index
