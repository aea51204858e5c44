"""Cache correctness: cached == uncached, chunked == one shot, windows, positions after shortening, layouts."""

from __future__ import annotations

import pytest
import torch

from kvforge import compat
from kvforge.cache import KVCache, KVLayer
from kvforge.decode import DecodeState, SamplingParams, decode, decode_uncached
from kvforge.prefill import forward, prefill


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 99, (1, n), generator=g)


@torch.no_grad()
def test_cached_greedy_equals_uncached_tokens_and_logits(model):
    prompt = _ids(30)[0].tolist()
    ref_tokens, ref_logits = decode_uncached(model, prompt, 20)  # sdpa, whole sequence each step
    cache = KVCache.for_model(model)
    logits = prefill(model, prompt, cache, chunk_size=None)
    seen = [logits[0].clone()]
    result = decode(model, cache, logits, DecodeState(20, on_token=lambda t: None))
    # replay to collect the logits at each step with the cache
    cache2 = KVCache.for_model(model)
    logits = prefill(model, prompt, cache2, chunk_size=None)
    for t in result.token_ids[:-1]:
        logits = forward(model, [t], cache2)[:, -1]
        seen.append(logits[0].clone())
    assert result.token_ids == ref_tokens
    torch.testing.assert_close(torch.stack(seen), ref_logits[: len(seen)], atol=1e-4, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_chunked_prefill_equals_single_shot(model, chunk_size):
    ids = _ids(50, seed=1)
    full = model(ids).logits[:, -1]
    one = prefill(model, ids, c1 := KVCache.for_model(model), chunk_size=None)
    chunked = prefill(model, ids, c2 := KVCache.for_model(model), chunk_size=chunk_size)
    torch.testing.assert_close(one, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked, one, atol=1e-5, rtol=0)
    for a, b in zip(c1.layers, c2.layers, strict=True):
        torch.testing.assert_close(a.view()[0], b.view()[0], atol=1e-5, rtol=0)
    assert c1.next_position == c2.next_position == 50


@torch.no_grad()
def test_sliding_window_keeps_exactly_sinks_and_window(model):
    window, sinks = 8, 2
    cache = KVCache.for_model(model, window=window, num_sink=sinks, block_size=4)
    logits = prefill(model, _ids(20), cache, chunk_size=5)
    decode(model, cache, logits, 40)
    last = cache.next_position - 1
    expected = list(range(sinks)) + list(range(last - window + 1, last + 1))
    for layer, native in zip(cache.layers, cache.native_windows, strict=True):
        if native is None:
            assert layer.visible_positions(last) == expected
            # memory is bounded: at most sinks + window + one block of slack held
            assert layer.length <= sinks + window + layer.block_size + 1
        else:  # a model's own sliding layer (Gemma3) keeps its native window, no sinks
            assert layer.visible_positions(last) == list(range(last - native + 1, last + 1))


@torch.no_grad()
def test_sliding_window_memory_bound_is_window_plus_sinks_plus_one_block_plus_one_forward(model):
    """The true bound of a sliding-window cache: queries attend to exactly ``num_sink + window`` entries, but the
    entries that fell out are compacted away only once a block of them has built up (amortised), and before the
    forward's own tokens are appended. After a forward of ``s`` tokens a layer holds at most
    ``num_sink + window + block_size + s`` entries, and decoding (s = 1) reaches that bound exactly."""
    window, sinks, block, chunk = 32, 4, 16, 8
    cache = KVCache.for_model(model, window=window, num_sink=sinks, block_size=block)
    windowed = [layer for layer, native in zip(cache.layers, cache.native_windows, strict=True) if native is None]
    slack = sinks + window + block

    def held() -> int:
        return max(layer.length for layer in windowed)

    prefill_peak = 0
    ids = _ids(200)
    for start in range(0, 200, chunk):
        forward(model, ids[:, start : start + chunk], cache)
        prefill_peak = max(prefill_peak, held())
    assert slack < prefill_peak <= slack + chunk  # a prompt chunk lands on top of the untrimmed slack

    decode_peak = 0
    for token in _ids(150, seed=1)[0]:
        forward(model, token.view(1, 1), cache)
        decode_peak = max(decode_peak, held())
        last = cache.next_position - 1
        for layer in windowed:  # what attention sees is the window itself
            assert len(layer.visible_positions(last)) == sinks + window
    assert decode_peak == slack + 1


@torch.no_grad()
def test_sliding_window_chunked_equals_token_by_token(model):
    ids = _ids(40, seed=2)
    a = KVCache.for_model(model, window=6, num_sink=3, block_size=4)
    b = KVCache.for_model(model, window=6, num_sink=3, block_size=4)
    la = prefill(model, ids, a, chunk_size=13)
    lb = prefill(model, ids, b, chunk_size=1)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)


@torch.no_grad()
def test_decode_does_not_reallocate_every_step(model):
    cache = KVCache.for_model(model, block_size=64)
    logits = prefill(model, _ids(10), cache)
    ptrs = {layer.keys.data_ptr() for layer in cache.layers}
    decode(model, cache, logits, 50)  # 60 tokens < one block of 64: no reallocation at all
    assert {layer.keys.data_ptr() for layer in cache.layers} == ptrs
    assert all(layer.num_reallocations == 0 for layer in cache.layers)
    decode(model, cache, forward(model, [5], cache), 200)  # crossing blocks: one reallocation per block at most
    assert all(layer.num_reallocations <= 4 for layer in cache.layers)


@torch.no_grad()
def test_positions_continue_from_tokens_processed_after_shortening(model):
    """Drop half the entries; the next token must still sit at position = tokens processed (RoPE exact)."""
    from transformers import DynamicCache

    ids = _ids(24, seed=3)
    cache = KVCache.for_model(model)
    prefill(model, ids, cache)
    keep = torch.arange(0, 24, 2)
    ref = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        k, v, p, _ = layer.view()
        k, v, p = k[:, :, keep], v[:, :, keep], p[:, :, keep]
        layer.replace(k.clone(), v.clone(), p.clone())
        ref.update(k.clone(), v.clone(), i)
    assert cache.next_position == 24 and cache.lengths()[0] == 12
    ours = forward(model, [7], cache)
    model.set_attn_implementation("sdpa")
    theirs = model(torch.tensor([[7]]), **compat.cache_arg(model, ref), position_ids=torch.tensor([[24]])).logits
    if any(w is not None for w in cache.native_windows):
        pytest.skip("sliding-window layers: the reference DynamicCache crops differently")
    torch.testing.assert_close(ours[:, -1], theirs[:, -1], atol=1e-5, rtol=0)


@torch.no_grad()
def test_headwise_packing_equals_masking_and_frees_memory(model):
    ids = _ids(32, seed=4)
    packed, masked = KVCache.for_model(model), KVCache.for_model(model)
    prefill(model, ids, packed)
    prefill(model, ids, masked)
    g = torch.Generator().manual_seed(0)
    for lp, lm in zip(packed.layers, masked.layers, strict=True):
        k, v, p, _ = lp.view()
        keep = torch.rand(p.shape, generator=g) < torch.linspace(0.2, 0.8, p.shape[1])[None, :, None]
        keep[..., -1] = True
        lp.replace_masked(k.clone(), v.clone(), p.clone(), keep)
        lm.replace(k.clone(), v.clone(), p.clone(), valid=keep)  # same entries, masked in place
        assert lp.num_entries() == int(keep.sum())
        assert lp.length == int(keep.sum(-1).max()) < lm.length
    assert packed.nbytes() < masked.nbytes()
    for t in (5, 9, 11):
        torch.testing.assert_close(forward(model, [t], packed), forward(model, [t], masked), atol=1e-5, rtol=0)


@torch.no_grad()
def test_sampling_with_seed_is_reproducible(model):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=123)
    runs = []
    for _ in range(2):
        cache = KVCache.for_model(model)
        runs.append(decode(model, cache, prefill(model, _ids(12), cache), DecodeState(25, params)).token_ids)
    assert runs[0] == runs[1]
    other = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=124)
    cache = KVCache.for_model(model)
    assert decode(model, cache, prefill(model, _ids(12), cache), DecodeState(25, other)).token_ids != runs[0]


def test_failed_forward_rolls_back(model):
    cache = KVCache.for_model(model)
    prefill(model, _ids(10), cache)
    with pytest.raises(IndexError):
        forward(model, torch.tensor([[5, 10_000]]), cache)  # out-of-vocabulary id fails inside the model
    assert cache.lengths() == [10] * cache.num_layers and cache.next_position == 10


def test_layer_validates_inputs():
    with pytest.raises(ValueError):
        KVLayer(window=0)
    layer = KVLayer()
    with pytest.raises(ValueError):
        layer.replace(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 5, dtype=torch.long))


@torch.no_grad()
def test_segment_round_trip_restores_cache(model):
    ids = _ids(20, seed=5)
    cache = KVCache.for_model(model)
    prefill(model, ids, cache)
    segment = cache.to_segment(model_id="m")
    restored = KVCache.from_segment(segment, model)
    assert restored.next_position == 20 and restored.token_ids == ids[0].tolist()
    torch.testing.assert_close(forward(model, [4], restored), forward(model, [4], cache), atol=0, rtol=0)


def test_softcapped_eager_path_matches_sdpa_when_the_cap_is_inactive():
    """The eager path (used for soft-capped logits) computes the same attention as sdpa, masks included."""
    from kvforge.attention import kvforge_attention

    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, h, 6, 8, generator=g) for h in (4, 2, 2))
    module = torch.nn.Module()
    module.layer_idx = 0
    mask = torch.rand(1, 1, 6, 6, generator=g) > 0.3
    mask[..., 0] = True
    for attention_mask, window in ((None, None), (mask, None), (None, 3)):
        plain, _ = kvforge_attention(module, query, key, value, attention_mask, sliding_window=window)
        capped, _ = kvforge_attention(module, query, key, value, attention_mask, sliding_window=window, softcap=1e9)
        torch.testing.assert_close(capped, plain, atol=1e-5, rtol=0)
    plain, _ = kvforge_attention(module, query, key, value, None)
    capped, _ = kvforge_attention(module, query, key, value, None, softcap=0.5)
    assert not torch.allclose(capped, plain)  # a real cap changes the result


def test_attention_hook_is_the_declared_way_to_replace_attention(model):
    """A hook that inherits nothing, set as ``cache.attention_hook``, replaces the softmax of every layer."""
    from kvforge.attention import attend, attention_scores

    ids = _ids(20, seed=3)
    plain = prefill(model, ids, KVCache.for_model(model), chunk_size=None)
    calls: list[int] = []

    class Eager:  # same math as sdpa, so the logits must not change
        def __call__(self, module, query, key, value, mask, is_causal, scaling, softcap):
            calls.append(module.layer_idx)
            return attend(torch.softmax(attention_scores(query, key, mask, is_causal, scaling, softcap), dim=-1), value)

    cache = KVCache.for_model(model)
    assert cache.attention_hook is None
    cache.attention_hook = Eager()
    hooked = prefill(model, ids, cache, chunk_size=None)
    assert sorted(set(calls)) == list(range(model.config.num_hidden_layers))
    torch.testing.assert_close(hooked, plain, atol=1e-4, rtol=0)

    class Zero:  # a hook that changes attention must change the logits: the hook is really used
        def __call__(self, module, query, key, value, mask, is_causal, scaling, softcap):
            return torch.zeros_like(query).transpose(1, 2)

    cache = KVCache.for_model(model)
    cache.attention_hook = Zero()
    assert not torch.allclose(prefill(model, ids, cache, chunk_size=None), plain, atol=1e-3)


def test_a_cache_from_a_stored_segment_holds_its_entries_where_the_model_runs(model, monkeypatch):
    """A segment read from a store is on the CPU; the cache built from it for a model gets its entries on the model's
    device (the meta device stands in for CUDA; the layers only record where their entries arrive)."""
    import copy

    cache = KVCache.for_model(model)
    prefill(model, [5, 6, 7, 8], cache)
    segment = cache.to_segment("m", [5, 6, 7, 8])
    arrived = []

    def record(self, keys, values, positions, valid=None):
        arrived.extend((k.device, v.device) for k, v in zip(keys, values, strict=True))

    monkeypatch.setattr(KVLayer, "replace_parts", record)
    KVCache.from_segment(segment, copy.deepcopy(model).to("meta"))
    assert arrived and all(k.type == v.type == "meta" for k, v in arrived)
    arrived.clear()
    KVCache.from_segment(segment)  # no model: the entries stay where the segment is
    assert arrived and all(k.type == "cpu" for k, _ in arrived)


@pytest.mark.parametrize("end", [None, 7, 8, 11])
def test_a_cache_from_stored_blocks_equals_the_cache_they_were_cut_from(model, end):
    """Blocks written as separate segments and read back (cut at any ``end``, inside a block, at its edge, past the
    last one) give the entries, positions and token ids of the cache they came from, and prefill on as it does."""
    ids = list(range(5, 17))
    cache = KVCache.for_model(model)
    prefill(model, ids, cache)
    blocks = [cache.to_segment("m", ids[s:e], start=s, end=e) for s, e in ((0, 4), (4, 8), (8, 12))]
    joined = KVCache.from_segments(blocks, model, end=end)
    stop = len(ids) if end is None else end
    assert joined.next_position == stop and joined.token_ids == ids[:stop]
    for got, want in zip(joined.layers, cache.layers, strict=True):
        k, v, p, valid = got.view()
        k0, v0, p0, _ = want.view()
        assert valid is None and got.run_start == 0
        torch.testing.assert_close(k, k0[:, :, :stop], rtol=0, atol=0)
        torch.testing.assert_close(v, v0[:, :, :stop], rtol=0, atol=0)
        assert torch.equal(p, p0[:, :, :stop])
    if stop < len(ids):
        torch.testing.assert_close(prefill(model, ids[stop:], joined), prefill(model, ids, KVCache.for_model(model)))
