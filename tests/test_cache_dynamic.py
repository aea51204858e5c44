"""KVCache <-> transformers.DynamicCache: exact round trip, same next-token logits, compressed caches refused."""

from __future__ import annotations

import pytest
import torch

from kvforge import compat
from kvforge.cache import KVCache
from kvforge.prefill import forward, prefill
from kvforge.testing import tiny_model


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dynamic_round_trip_is_exact_and_decodes_the_same(arch):
    model = tiny_model(arch)
    ids = torch.arange(3, 15)[None]  # shorter than gemma3's window: no entry dropped on either side
    cache = KVCache.for_model(model)
    prefill(model, ids, cache)
    dynamic = cache.to_dynamic()
    assert dynamic.get_seq_length() == 12
    back = KVCache.from_dynamic(dynamic, model)
    assert back.next_position == cache.next_position
    for a, b in zip(cache.layers, back.layers, strict=True):
        for x, y in zip(a.view()[:3], b.view()[:3], strict=True):
            assert torch.equal(x, y)
    ours = forward(model, [[20]], back)[:, -1]
    with torch.no_grad():
        out = model(torch.tensor([[20]]), **compat.cache_arg(model, dynamic), position_ids=torch.tensor([[12]]))
        theirs = out.logits[:, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_compressed_cache_is_refused():
    model = tiny_model("llama")
    cache = KVCache.for_model(model)
    prefill(model, torch.arange(3, 15)[None], cache)
    for layer in cache.layers:
        k, v, p, _ = layer.view()
        layer.replace(k[:, :, ::2].clone(), v[:, :, ::2].clone(), p[:, :, ::2].clone())
    with pytest.raises(ValueError, match="cannot represent"):
        cache.to_dynamic()


def test_answer_many_compresses_once_and_equals_answer(tokenizer):
    from kvforge.engine import Engine
    from kvforge.presses import build_press

    engine = Engine(tiny_model("llama"), tokenizer, chunk_size=16)
    context = "The red boat sails at noon. The blue boat waits in the harbour until the tide turns."
    questions = ["Which boat sails?", "When does it sail?"]
    press = build_press("snapkv", compression_ratio=0.5, window_size=4)
    many = engine.answer_many(context, questions, press=press, max_new_tokens=5)
    for question, gen in zip(questions, many, strict=True):
        one = engine.answer(context, question, press=press, query_aware=False, max_new_tokens=5)
        assert gen.token_ids == one.token_ids and gen.info["cache_entries"] == one.info["cache_entries"]
