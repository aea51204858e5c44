"""A cache stored and loaded back continues exactly like the original (tiny random models, every store)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvforge.cache import KVCache
from kvforge.prefill import forward, prefill
from kvforge.store import DiskStore, MemoryStore, TieredStore
from kvforge.testing import tiny_model


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return tiny_model("llama")


@torch.no_grad()
@pytest.mark.parametrize(("arch", "headwise"), [("llama", False), ("llama", True), ("gemma3", False)])
def test_stored_cache_continues_bit_exactly(llama: torch.nn.Module, tmp_path: Path, arch: str, headwise: bool) -> None:
    model = llama if arch == "llama" else tiny_model(arch)  # gemma3: sliding-window layers
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(model)
    prefill(model, ids[:, :32], cache)
    if headwise:  # an AdaKV-like selection: each head keeps different entries of layer 0
        layer = cache.layers[0]
        keys, values, positions, _ = layer.view()
        keep = torch.rand(positions.shape, generator=torch.Generator().manual_seed(1)) > 0.4
        layer.replace_masked(keys.clone(), values.clone(), positions.clone(), keep)
    segment = cache.to_segment(model_id="tiny", token_ids=ids[0, :32].tolist())
    store = TieredStore([MemoryStore(), DiskStore(tmp_path)])
    store.put("ab", segment)
    store.tiers[0].clear()  # load from disk
    loaded = KVCache.from_segment(store.get("ab"), model)
    expected = forward(model, ids[:, 32:], cache, logits_to_keep=8)
    got = forward(model, ids[:, 32:], loaded, logits_to_keep=8)
    assert torch.equal(expected, got)


@torch.no_grad()
def test_quantised_cache_stays_close(llama: torch.nn.Module) -> None:
    model = llama
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(model)
    prefill(model, ids[:, :32], cache)
    store = MemoryStore(quant="int8-kivi")
    store.put("ab", cache.to_segment(model_id="tiny"))
    loaded = KVCache.from_segment(store.get("ab"), model)
    expected = forward(model, ids[:, 32:], cache, logits_to_keep=8).softmax(-1)
    got = forward(model, ids[:, 32:], loaded, logits_to_keep=8).softmax(-1)
    assert (expected - got).abs().max() < 0.02


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_cache_round_trips_through_disk(smollm2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from kvforge.errors import ModelMismatchError
    from kvforge.model import model_fingerprint
    from kvforge.store import check_segment, open_store

    model, tokenizer = smollm2
    fingerprint = model_fingerprint(model, tokenizer)
    ids = torch.tensor([tokenizer("The store keeps the KV cache of this sentence, bit for bit.").input_ids])
    cache = KVCache.for_model(model)
    prefill(model, ids[:, :-4], cache)
    segment = cache.to_segment(model_id=fingerprint, token_ids=ids[0, :-4].tolist())
    assert segment.nbytes() == 2 * 30 * 3 * 64 * 4 * segment.num_tokens  # the size the throughput benchmark assumes
    open_store(f"file://{tmp_path}").put("ab", segment)
    loaded = open_store(f"file://{tmp_path}").get("ab")  # as another process would
    check_segment(loaded, fingerprint, expect_dtype=model.dtype)
    with pytest.raises(ModelMismatchError):
        check_segment(loaded, fingerprint + "-other-model")
    expected = forward(model, ids[:, -4:], cache, logits_to_keep=4)
    assert torch.equal(forward(model, ids[:, -4:], KVCache.from_segment(loaded, model), logits_to_keep=4), expected)
