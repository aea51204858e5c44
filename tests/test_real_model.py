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
