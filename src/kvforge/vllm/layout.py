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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
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
    key_strides: tuple[int, int, int, int] | None = field(init=False, default=None)
    value_strides: tuple[int, int, int, int] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_strides", _affine(self.key_index))
        object.__setattr__(self, "value_strides", _affine(self.value_index))

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
        if _use_numpy(cache):  # one thread, no OpenMP team to wait for on a busy machine
            blocks = _as_numpy(cache)[np.asarray(block_ids, dtype=np.int64)]
            out = [_from_numpy(self._unpack(blocks, *part), cache.dtype) for part in self._parts()]
        else:
            ids = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
            blocks_t = cache.index_select(0, ids)
            out = [self._unpack(blocks_t, *part) for part in self._parts()]
        return out[0], out[1]

    def scatter(self, cache: Tensor, block_ids: Sequence[int] | Tensor, keys: Tensor, values: Tensor) -> None:
        """Write ``keys``/``values`` ``(H_kv, len(block_ids) * N, D)`` into ``block_ids`` (other bytes of those blocks,
        such as padding, are kept)."""
        self._check(cache)
        n = len(block_ids)
        h, t, d = self.key_index.shape
        if keys.shape != (h, n * t, d) or values.shape != keys.shape:
            raise ValueError(f"expected keys and values of shape {(h, n * t, d)}, got {tuple(keys.shape)}")
        data = [
            x.to(device=cache.device, dtype=cache.dtype).reshape(h, n, t, d).transpose(0, 1) for x in (keys, values)
        ]
        on_cpu = _use_numpy(cache)
        if on_cpu and self.key_strides is not None and self.value_strides is not None:
            whole = _as_numpy(cache)
            if whole[:1].flags.c_contiguous:  # each block written in place through a strided view: no copies
                for j, block in enumerate(np.asarray(block_ids, dtype=np.int64).tolist()):
                    for (index, strides), rows in zip(self._parts(), data, strict=True):
                        self._view(whole[block : block + 1], index, strides)[...] = _as_numpy(rows[j : j + 1])
                return
        if on_cpu:  # numpy, as in gather
            ids: Any = np.asarray(block_ids, dtype=np.int64)
            blocks: Any = _as_numpy(cache)[ids]  # a copy: the bytes of these blocks that are not K/V are kept
        else:
            ids = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
            blocks = cache.index_select(0, ids)
        for (index, strides), rows in zip(self._parts(), data, strict=True):
            src = _as_numpy(rows) if on_cpu else rows
            if strides is None:  # element by element
                flat = blocks.reshape(n, -1)
                flat[:, index.numpy().reshape(-1) if on_cpu else index.reshape(-1)] = src.reshape(n, -1)
            else:
                self._view(blocks, index, strides)[...] = src
        if on_cpu:
            _as_numpy(cache)[ids] = blocks
        else:
            cache.index_copy_(0, ids, blocks)

    def _parts(self) -> tuple[tuple[Tensor, tuple[int, int, int, int] | None], ...]:
        return (self.key_index, self.key_strides), (self.value_index, self.value_strides)

    def _view(self, blocks: Any, index: Tensor, strides: tuple[int, int, int, int] | None) -> Any:
        """``(n, H_kv, N, D)`` keys (or values) of contiguous ``blocks`` ``(n, *block_shape)``: a strided view when
        the layout is strided (every backend seen so far), else a gathered copy (numpy array or tensor)."""
        n = blocks.shape[0]
        h, t, d = index.shape
        flat = blocks.reshape(n, -1)
        if strides is None:
            picked = flat[:, index.numpy().reshape(-1) if isinstance(flat, np.ndarray) else index.reshape(-1)]
            return picked.reshape(n, h, t, d)
        offset, *steps = strides
        if isinstance(flat, np.ndarray):
            size = flat.itemsize
            return np.lib.stride_tricks.as_strided(
                flat.reshape(-1)[offset:], (n, h, t, d), (flat.shape[1] * size, *(x * size for x in steps))
            )
        return flat.as_strided((n, h, t, d), (flat.shape[1], *steps), flat.storage_offset() + offset)

    def _unpack(self, blocks: Any, index: Tensor, strides: tuple[int, int, int, int] | None) -> Any:
        """One copy of the keys (or values) of ``blocks`` into ``(H_kv, n * N, D)``."""
        view = self._view(blocks, index, strides)
        n, h, t, d = view.shape
        if isinstance(view, np.ndarray):
            return np.ascontiguousarray(view.transpose(1, 0, 2, 3)).reshape(h, n * t, d)
        return view.transpose(0, 1).reshape(h, n * t, d)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _use_numpy(cache: Tensor) -> bool:
    """CPU caches are copied with numpy: inside vLLM's CPU worker every small torch op waits for an OpenMP team, and
    on a loaded machine a 2-block ``index_select`` took 20-60 ms where numpy takes 0.03 ms."""
    return cache.device.type == "cpu"


def _as_numpy(tensor: Tensor) -> np.ndarray:
    """The tensor's memory as a numpy array of same-sized integers (bf16 has no numpy type; bytes are bytes)."""
    return tensor.view(_INT_OF_SIZE[tensor.element_size()]).numpy()


def _from_numpy(array: np.ndarray, dtype: torch.dtype) -> Tensor:
    return torch.from_numpy(array).view(dtype)


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


def _affine(index: Tensor) -> tuple[int, int, int, int] | None:
    """``(offset, head step, token step, channel step)`` when ``index[h, t, d] = offset + h*sh + t*st + d*sd``."""
    h, t, d = index.shape
    offset = int(index[0, 0, 0])
    steps = [int(index[1, 0, 0]) - offset if h > 1 else 0, int(index[0, 1, 0]) - offset if t > 1 else 0,
             int(index[0, 0, 1]) - offset if d > 1 else 0]  # fmt: skip
    if min(steps) < 0:
        return None
    grid = (torch.arange(h)[:, None, None] * steps[0] + torch.arange(t)[None, :, None] * steps[1]
            + torch.arange(d)[None, None, :] * steps[2] + offset)  # fmt: skip
    return (offset, steps[0], steps[1], steps[2]) if torch.equal(grid, index) else None


def _invert(decoded: Tensor, where: Tensor, count: int, what: str) -> Tensor:
    """Offset of each element number ``0..count-1`` given the number found at each offset (``where`` holds it)."""
    offsets = where.nonzero().flatten()
    numbers = decoded[offsets]
    if offsets.numel() != count or not torch.equal(numbers.sort().values, torch.arange(count)):
        raise LayoutError(f"the backend does not store each {what} element exactly once in a block")
    index = torch.empty(count, dtype=torch.long)
    index[numbers] = offsets
    return index
