"""Defence in depth for stored KV: a segment of another shape or dtype is refused before use, and a
model fingerprint never survives a change of the model's dtype or weights."""

from __future__ import annotations

import pytest
import torch

from kvforge.cache import KVCache, mismatch_with_model
from kvforge.model import model_fingerprint
from kvforge.prefill import prefill
from kvforge.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _cache(model) -> KVCache:
    cache = KVCache.for_model(model)
    prefill(model, torch.tensor([[3, 4, 5, 6]]), cache)
    return cache


def test_a_matching_cache_fits(llama) -> None:
    assert mismatch_with_model(_cache(llama), llama) is None


def test_other_layer_count_heads_head_dim_or_dtype_is_refused(llama) -> None:
    seg = _cache(llama).to_segment("m")
    fewer = type(seg)(**{**seg.__dict__, "keys": seg.keys[:-1], "values": seg.values[:-1],
                         "positions": seg.positions[:-1], "valid": seg.valid[:-1]})  # fmt: skip
    assert "layers" in mismatch_with_model(KVCache.from_segment(fewer), llama)
    heads = type(seg)(**{**seg.__dict__, "keys": [torch.cat([k, k]) for k in seg.keys],
                         "values": [torch.cat([v, v]) for v in seg.values],
                         "positions": [torch.cat([p, p]) for p in seg.positions], "valid": seg.valid})  # fmt: skip
    assert "KV heads" in mismatch_with_model(KVCache.from_segment(heads), llama)
    dim = type(seg)(**{**seg.__dict__, "keys": [k[..., :-2] for k in seg.keys],
                       "values": [v[..., :-2] for v in seg.values]})  # fmt: skip
    assert "head dim" in mismatch_with_model(KVCache.from_segment(dim), llama)
    half = type(seg)(**{**seg.__dict__, "keys": [k.half() for k in seg.keys], "values": [v.half() for v in seg.values]})
    assert "float16" in mismatch_with_model(KVCache.from_segment(half), llama)


def test_fingerprint_does_not_survive_a_dtype_change_or_new_weights() -> None:
    model, tok = tiny_model("llama"), tiny_tokenizer()
    before = model_fingerprint(model, tok)
    assert model_fingerprint(model, tok) == before
    model.to(torch.bfloat16)
    after = model_fingerprint(model, tok)
    assert after != before and after.endswith("bfloat16")
    model.to(torch.float32)  # cast back: same dtype, but the bf16 round trip changed the weights
    back = model_fingerprint(model, tok)
    assert back.endswith("float32") and back != after
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # in-place update
    assert model_fingerprint(model, tok) != back
