"""Paged-block layouts learnt from a backend's writer (no vLLM needed: fake writers lay blocks out as backends do)."""

from __future__ import annotations

import pytest
import torch

from kvforge.vllm import layout as layout_module
from kvforge.vllm.layout import LayoutError, probe_layout

H, N, D = 3, 8, 4  # KV heads, tokens per block, head dim


def write_head_major(keys, values, cache, slots):
    """[B, H, N, 2D]: each token's key then value (as flash attention's standard view)."""
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, cache.shape[2])
        cache[b, :, t, :D] = keys[i]
        cache[b, :, t, D:] = values[i]


def write_cpu_vec(keys, values, cache, slots):
    """vLLM's CPU "vec" path: per block and head, keys transposed ([D, N]) then values ([N, D])."""
    n = cache.shape[2]
    view = cache.view(cache.shape[0], cache.shape[1], 2 * n, -1)  # (B, H, 2N, D): first N rows keys, then values
    key_part = view[:, :, :n].reshape(cache.shape[0], cache.shape[1], D, n)  # transposed
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, n)
        key_part[b, :, :, t] = keys[i]
        view[b, :, n + t] = values[i]


def write_padded(keys, values, cache, slots):
    """[B, H, N + 1, 2D] with a padding row per head that the backend never writes."""
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, N)
        cache[b, :, t, :D] = keys[i]
        cache[b, :, t, D:] = values[i]


PERM = [3, 0, 7, 1, 6, 2, 5, 4]  # a tile-like order no stride describes


def write_shuffled(keys, values, cache, slots):
    """Tokens in a permuted order inside the block: no strided view; the general path must handle it."""
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, N)
        cache[b, :, PERM[t], :D] = keys[i]
        cache[b, :, PERM[t], D:] = values[i]


def shape_of(writer):
    return (H, N + 1, 2 * D) if writer is write_padded else (H, N, 2 * D)


@pytest.fixture(params=["numpy", "torch"])
def copies(request, monkeypatch):
    """CPU caches are copied with numpy; the torch path (GPU caches) runs on CPU tensors here too."""
    if request.param == "torch":
        monkeypatch.setattr(layout_module, "_use_numpy", lambda cache: False)
    return request.param


@pytest.mark.parametrize("writer", [write_head_major, write_cpu_vec, write_padded, write_shuffled])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_returns_what_the_backend_wrote(writer, dtype, copies):
    layout = probe_layout(writer, shape_of(writer), N, H, D, dtype)
    num_blocks = 5
    cache = torch.zeros((num_blocks, *shape_of(writer)), dtype=dtype)
    keys = torch.randn(2 * N, H, D).to(dtype)  # two blocks' worth of tokens, in vLLM's (tokens, heads, dim)
    values = torch.randn(2 * N, H, D).to(dtype)
    block_ids = [3, 1]  # not in order: a request's blocks are wherever the allocator put them
    slots = torch.tensor([b * N + t for b in block_ids for t in range(N)])
    writer(keys, values, cache, slots)
    got_k, got_v = layout.gather(cache, block_ids)  # (H, 2N, D)
    assert torch.equal(got_k, keys.transpose(0, 1))
    assert torch.equal(got_v, values.transpose(0, 1))


@pytest.mark.parametrize("writer", [write_head_major, write_cpu_vec, write_padded, write_shuffled])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spaced", ["", "blocks", "inside"])
def test_scatter_is_what_the_backend_would_write_and_keeps_other_bytes(writer, dtype, spaced, copies):
    """Blocks written out of order keep every other byte. CPU caches are written in place block by block, also when
    the blocks are apart (``blocks``: every other block of a larger cache); a cache whose blocks are not contiguous
    inside (``inside``: half of a wider last dimension) goes through a copy of its blocks."""
    layout = probe_layout(writer, shape_of(writer), N, H, D, dtype)
    block_ids = [2, 0]
    keys, values = torch.randn(2 * N, H, D).to(dtype), torch.randn(2 * N, H, D).to(dtype)

    def blank():  # 7.0 stands for other blocks' data and padding
        *inner, last = shape_of(writer)
        if spaced == "blocks":
            return torch.full((8, *inner, last), 7.0, dtype=dtype)[::2]
        if spaced == "inside":
            return torch.full((4, *inner, 2 * last), 7.0, dtype=dtype)[..., :last]
        return torch.full((4, *inner, last), 7.0, dtype=dtype)

    expected = blank().contiguous()
    writer(keys, values, expected, torch.tensor([b * N + t for b in block_ids for t in range(N)]))
    cache = blank()
    layout.scatter(cache, block_ids, keys.transpose(0, 1), values.transpose(0, 1))
    assert torch.equal(cache, expected)


def test_strided_layouts_are_recognised_and_others_are_not():
    vec = probe_layout(write_cpu_vec, (H, N, 2 * D), N, H, D, torch.float32)
    assert vec.key_strides == (0, 2 * N * D, 1, N)  # keys transposed: token step 1, channel step N
    assert vec.value_strides == (N * D, 2 * N * D, D, 1)
    shuffled = probe_layout(write_shuffled, (H, N, 2 * D), N, H, D, torch.float32)
    assert shuffled.key_strides is None and shuffled.value_strides is None


def test_a_backend_that_transforms_values_is_refused():
    def write_scaled(keys, values, cache, slots):
        write_head_major(keys * 0.5, values, cache, slots)

    with pytest.raises(LayoutError, match="transforms"):
        probe_layout(write_scaled, (H, N, 2 * D), N, H, D, torch.float32)


def test_a_backend_that_drops_elements_is_refused():
    def write_keys_only(keys, values, cache, slots):
        write_head_major(keys, torch.zeros_like(values), cache, slots)

    with pytest.raises(LayoutError, match="value element"):
        probe_layout(write_keys_only, (H, N, 2 * D), N, H, D, torch.float32)


def test_a_block_too_small_for_the_model_is_refused():
    with pytest.raises(LayoutError, match="cannot hold"):
        probe_layout(write_head_major, (H, N, D), N, H, D, torch.float32)


def test_a_cache_of_another_shape_is_refused():
    layout = probe_layout(write_head_major, (H, N, 2 * D), N, H, D, torch.float32)
    with pytest.raises(LayoutError, match="probed"):
        layout.gather(torch.zeros(2, H, N + 1, 2 * D), [0])
