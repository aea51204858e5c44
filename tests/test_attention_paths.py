"""Which attention path a forward takes, and that each one computes exactly masked softmax attention.

A later chunk of a plain cache runs on the causal kernels (lower-right, no mask); a cache that needs a mask
(compressed, head-wise, window) still gets one, per KV head; decoding folds GQA groups into their KV head.
"""

from __future__ import annotations

import pytest
import torch

from kvforge import attention
from kvforge.attention import attend, attention_scores, sdpa
from kvforge.cache import CacheSnapshot, KVCache, KVLayer
from kvforge.prefill import forward, prefill


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 99, (1, n), generator=torch.Generator().manual_seed(seed))


def _qkv(q_len: int, k_len: int, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, heads, q_len, 16, generator=g),
        torch.randn(2, kv_heads, k_len, 16, generator=g),
        torch.randn(2, kv_heads, k_len, 16, generator=g),
    )


def _reference(q, k, v, mask):
    """Eager masked softmax attention, mask ``(B, 1 or H, Q, K)``: ``(B, Q, H, D)``."""
    return attend(torch.softmax(attention_scores(q, k, mask, False, None, None), dim=-1), v)


def _lower_right(q_len: int, k_len: int) -> torch.Tensor:
    return torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)[None, None]


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize(("q_len", "k_len"), [(5, 12), (1, 9), (7, 7), (3, 4)])
@pytest.mark.parametrize("cpu_flash", [True, False])
def test_lower_right_causal_equals_the_masked_reference(monkeypatch, kv_heads, q_len, k_len, cpu_flash):
    if not cpu_flash:  # the causal_lower_right path (what CUDA takes), run on CPU
        monkeypatch.setattr(attention, "_cpu_flash_with_lse", lambda: None)
    q, k, v = _qkv(q_len, k_len, kv_heads=kv_heads)
    out = sdpa(q, k, v, None, q_len > 1, None)
    torch.testing.assert_close(out, _reference(q, k, v, _lower_right(q_len, k_len)), atol=1e-5, rtol=0)


def test_cpu_flash_probe_finds_the_kernel_here():
    assert attention._cpu_flash_with_lse() is not None  # else the CPU fast path silently never runs


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_decode_folds_gqa_groups_with_a_per_kv_head_mask(kv_heads):
    q, k, v = _qkv(1, 10, heads=4, kv_heads=kv_heads, seed=1)
    mask = torch.rand(2, kv_heads, 1, 10, generator=torch.Generator().manual_seed(2)) < 0.6
    mask[..., 0] = True
    expected = _reference(q, k, v, mask.repeat_interleave(4 // kv_heads, 1))
    torch.testing.assert_close(sdpa(q, k, v, mask, False, None), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(sdpa(q, k, v, None, False, None), _reference(q, k, v, None), atol=1e-5, rtol=0)


def test_headwise_mask_is_per_kv_head():
    layer = KVLayer()
    keys = torch.randn(1, 2, 6, 4)
    keep = torch.tensor([[[1, 1, 0, 1, 0, 1], [0, 1, 1, 1, 1, 1]]], dtype=torch.bool)
    layer.replace_masked(keys, keys.clone(), torch.arange(6)[None], keep)
    mask = layer.attention_mask(torch.tensor([[9]]))
    assert mask is not None and tuple(mask.shape) == (1, 2, 1, 5)
    assert tuple(layer.attention_mask(torch.tensor([[9]]), num_query_heads=4).shape) == (1, 4, 1, 5)


def _no_mask(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError("a plain cache built a mask")

    monkeypatch.setattr(KVLayer, "attention_mask", refuse)


@torch.no_grad()
@pytest.mark.parametrize("chunk_size", [4, 16])
def test_chunked_prefill_of_a_plain_cache_builds_no_mask_and_equals_one_shot(monkeypatch, chunk_size):
    from kvforge.testing import tiny_model

    model = tiny_model("llama")
    ids = _ids(40, seed=3)
    one = prefill(model, ids, KVCache.for_model(model), chunk_size=None)
    _no_mask(monkeypatch)
    cache = KVCache.for_model(model)
    chunked = prefill(model, ids, cache, chunk_size=chunk_size)
    torch.testing.assert_close(chunked, one, atol=1e-4, rtol=0)
    assert all(layer.run_start == 0 for layer in cache.layers)
    full = model(ids).logits[:, -1]  # transformers' own sdpa forward
    torch.testing.assert_close(chunked, full, atol=1e-4, rtol=0)


@torch.no_grad()
def test_a_prefix_loaded_from_a_segment_continues_on_the_causal_path(monkeypatch):
    from kvforge.testing import tiny_model

    model = tiny_model("qwen2")
    ids = _ids(30, seed=4)
    full = prefill(model, ids, KVCache.for_model(model), chunk_size=None)
    first = KVCache.for_model(model)
    prefill(model, ids[:, :18], first)
    loaded = KVCache.from_segment(first.to_segment(), model)
    assert all(layer.run_start == 0 for layer in loaded.layers)
    _no_mask(monkeypatch)
    torch.testing.assert_close(prefill(model, ids[:, 18:], loaded), full, atol=1e-4, rtol=0)


@torch.no_grad()
def test_a_shortened_cache_is_not_plain_and_still_masks(model):
    ids = _ids(20, seed=5)
    cache = KVCache.for_model(model)
    prefill(model, ids, cache)
    for layer in cache.layers:
        k, v, p, _ = layer.view()
        keep = torch.tensor([i for i in range(p.shape[-1]) if i % 3 != 1])
        layer.replace(k[:, :, keep].clone(), v[:, :, keep].clone(), p[:, :, keep].clone())
        assert layer.run_start is None
    # a two-token forward after the gap: its queries must not see the dropped entries, and see each other causally
    out = forward(model, [5, 6], cache, logits_to_keep=2)
    assert out.shape[1] == 2 and torch.isfinite(out).all()
    assert not any(layer.is_plain_causal(torch.tensor([[20, 21]])) for layer in cache.layers)


def test_run_start_follows_appends_aborts_and_snapshots():
    cache = KVCache(1)
    layer = cache.layers[0]
    kv = torch.randn(1, 1, 3, 4)
    cache.begin(torch.arange(3)[None])
    cache.update(kv, kv, 0)
    cache.end(torch.zeros(1, 3, dtype=torch.long))
    assert layer.run_start == 0
    snap = CacheSnapshot(cache)
    cache.begin(torch.tensor([[7, 9]]))  # not contiguous: the run is broken
    cache.update(kv[:, :, :2], kv[:, :, :2], 0)
    assert layer.run_start is None
    cache.end(torch.zeros(1, 2, dtype=torch.long))
    snap.restore()
    assert layer.run_start == 0 and layer.length == 3
    cache.begin(torch.arange(3, 5)[None])
    cache.update(kv[:, :, :2], kv[:, :, :2], 0)
    assert layer.run_start == 0 and layer.is_plain_causal(torch.arange(3, 5)[None])
    cache.abort()
    assert layer.length == 3 and layer.run_start == 0


def test_the_placeholder_mask_follows_the_model_inputs_device():
    """kvforge hands the model a placeholder ``attention_mask``: it must be on the inputs' device (a CPU tensor
    passed to a CUDA model breaks any model code that touches it). The meta device stands in for CUDA here: mixing
    a CPU tensor into meta computations raises, as CUDA would. The forward is stopped before it runs (meta tensors
    hold no values), after the model has received its arguments."""
    from kvforge.prefill import call_model, masks_from_cache
    from kvforge.testing import tiny_model

    model = tiny_model("llama").to("meta")
    seen: dict[str, torch.Tensor] = {}

    class Stop(Exception):
        pass

    def capture(module, args, kwargs):
        seen.update(kwargs)
        raise Stop

    handle = model.register_forward_pre_hook(capture, with_kwargs=True)
    ids = torch.tensor([[1, 2, 3]], device="meta")
    try:
        with pytest.raises(Stop):
            call_model(model, ids, torch.arange(3, device="meta")[None], KVCache(2), logits_to_keep=1)
    finally:
        handle.remove()
    mask = seen["attention_mask"]
    assert mask.device.type == "meta" and mask.dtype == torch.bool and mask.shape == (1, 1, 1, 1)
    assert masks_from_cache(torch.device("cpu")).device.type == "cpu"
    assert masks_from_cache(torch.device("meta")) is mask  # made once per device
    assert not mask.is_inference()  # usable outside inference mode too


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("group", [2, 3, 128])
def test_queries_up_to_their_slots_equal_the_masked_reference(monkeypatch, kv_heads, group):
    """RAG recompute: queries written to ascending slots see the keys up to their own slot (groups split into the
    keys before the group, unmasked, and a band; a contiguous group runs causally)."""
    monkeypatch.setattr(attention, "SLOT_GROUP", group)
    slots = torch.tensor([0, 1, 2, 5, 9, 10, 11, 17, 18, 30, 31])
    q, _, _ = _qkv(len(slots), 32, kv_heads=kv_heads, seed=3)
    _, k, v = _qkv(len(slots), 32, kv_heads=kv_heads, seed=4)
    mask = (torch.arange(32)[None, :] <= slots[:, None])[None, None]
    out = attention._up_to_slots(q, k, v, slots, None)
    torch.testing.assert_close(out, _reference(q, k, v, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("ratio", [0.3, 1.0])
@pytest.mark.parametrize(
    ("arch", "path", "gate"),
    [("llama", "_up_to_slots", "sorted_query_slots"), ("gemma3", "_in_window_bands", "window_query_slots")],
)
def test_a_rag_recompute_takes_the_fast_path_with_the_masked_paths_logits(monkeypatch, ratio, arch, path, gate):
    """A RAG plan's recompute (reserved slots in position order) runs on the slot path (full attention: keys up to
    each query's slot) or in bands (sliding-window layers: the window before each group of queries), in several
    groups, and gives the logits of the positional mask over every key."""
    from rag_helpers import RagRunner

    from kvforge.reuse.rag import make_strategy
    from kvforge.testing import tiny_model, tiny_tokenizer

    model = tiny_model(arch, num_hidden_layers=3)  # gemma3: sliding, sliding, full
    runner = RagRunner(model, tiny_tokenizer())
    docs = ["The cat sat on the mat, then it slept all day.", "Paris is the capital of France.", "The code is 7731."]
    prompt = runner.build_prompt(docs, "What is the code?", system="Answer briefly.")
    window = getattr(model.config, "sliding_window", None)
    assert window is None or len(prompt.ids()) > 2 * window  # the window hides entries
    monkeypatch.setattr(attention, "SLOT_GROUP", 3)
    calls = []
    real = getattr(attention, path)
    monkeypatch.setattr(attention, path, lambda *a: calls.append(1) or real(*a))
    fast = runner.prefill(prompt, make_strategy("cacheblend", ratio))
    assert calls, f"the recompute did not take {path}"
    monkeypatch.setattr(KVLayer, gate, lambda self: None)
    masked = runner.prefill(prompt, make_strategy("cacheblend", ratio))
    torch.testing.assert_close(fast.logits, masked.logits, atol=1e-5, rtol=0)


def test_window_bands_equal_the_window_mask_with_gaps_in_positions(monkeypatch):
    """Queries at ascending slots of a layer whose positions increase with gaps: bands from window - 1 slots before
    a group's first slot give what the window mask over every key gives."""
    positions = torch.tensor([0, 1, 2, 4, 7, 8, 9, 12, 13, 14, 20, 21])
    slots = torch.tensor([2, 3, 6, 7, 8, 10, 11])
    window = 4
    layer = KVLayer(window=window)
    _, k, v = _qkv(len(positions), len(positions), kv_heads=2, seed=5)
    layer.replace(k, v, positions[None, None].expand(2, 2, -1).clone())
    q, _, _ = _qkv(len(slots), len(positions), kv_heads=2, seed=6)
    q_pos = positions[slots][None].expand(2, -1)
    mask = ((positions[None, :] <= q_pos[0, :, None]) & (q_pos[0, :, None] - positions[None, :] < window))[None, None]
    for group in (1, 2, 3, 16):
        monkeypatch.setattr(attention, "SLOT_GROUP", group)
        out = attention._in_window_bands(q, k, v, slots, layer, q_pos, None)
        torch.testing.assert_close(out, _reference(q, k, v, mask), atol=1e-5, rtol=0)
