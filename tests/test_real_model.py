"""Truth on the bundled SmolLM2-135M-Instruct (offline, real weights): cached == uncached, and it answers."""

from __future__ import annotations

import pytest
import torch

from kvforge.cache import KVCache
from kvforge.decode import decode, decode_uncached
from kvforge.engine import Engine
from kvforge.prefill import forward, prefill

pytestmark = pytest.mark.slow


@torch.no_grad()
def test_smollm2_cached_equals_uncached(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer)
    ids = engine.encode_chat("Name three colours.")
    ref_tokens, ref_logits = decode_uncached(model, ids, 12)
    cache = KVCache.for_model(model)
    logits = prefill(model, ids, cache, chunk_size=8)
    seen = [logits[0]]
    out = decode(model, cache, logits, 12)
    assert out.token_ids == ref_tokens
    cache = KVCache.for_model(model)
    logits = prefill(model, ids, cache)
    for t in out.token_ids[:-1]:
        seen.append(forward(model, [t], cache)[0, -1])
    torch.testing.assert_close(torch.stack(seen), ref_logits[: len(seen)], atol=1e-4, rtol=0)


def test_smollm2_answers_paris(smollm2):
    engine = Engine(*smollm2)
    assert "Paris" in engine.generate("What is the capital of France? Answer in one word.", max_new_tokens=12).text


@torch.no_grad()
def test_gemma3_sliding_layers_cached_equals_uncached():
    """Gemma-3-270M: a prompt longer than its 512-token sliding window, decoded with and without the cache."""
    from kvforge.errors import UserError
    from kvforge.model import load_model

    try:
        model, tokenizer = load_model("gemma3-270m", device="cpu")
    except UserError as e:
        pytest.skip(f"gemma3-270m not available: {e}")
    window = model.config.get_text_config().sliding_window
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 70).input_ids[: window + 100]
    ref_tokens, ref_logits = decode_uncached(model, ids, 6)
    cache = KVCache.for_model(model)
    logits = prefill(model, ids, cache, chunk_size=256)
    out = decode(model, cache, logits, 6)
    assert out.token_ids == ref_tokens
    torch.testing.assert_close(logits[0], ref_logits[0], atol=1e-3, rtol=0)
    sliding = [layer for layer, w in zip(cache.layers, cache.native_windows, strict=True) if w is not None]
    assert sliding and all(len(layer.visible_positions(cache.next_position - 1)) == window for layer in sliding)
