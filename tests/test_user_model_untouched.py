"""kvforge leaves the user's model as it was: after kvforge ran on it, the owner's own batched generate is unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from kvforge.engine import Engine
from kvforge.presses import build_press
from kvforge.testing import tiny_model, tiny_tokenizer


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_left_padded_batched_generate_after_kvforge_equals_an_untouched_copy(arch: str) -> None:
    model, tokenizer = tiny_model(arch), tiny_tokenizer()
    untouched = copy.deepcopy(model)
    engine = Engine(model, tokenizer, chunk_size=8)
    engine.generate("hello there, how are you", max_new_tokens=3)  # switches the model to kvforge attention
    pytest.importorskip("kvforge.presses")
    from kvforge.presses import build_press

    engine.answer("a long enough context for a press to act on it", "why?", press=build_press("snapkv", 0.5),
                  max_new_tokens=2)  # fmt: skip
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    expected = untouched.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, **kwargs), expected)
    with torch.no_grad():  # and a plain padded forward gives sdpa's logits on the real (unpadded) positions
        got, ref = model(ids, attention_mask=mask).logits, untouched(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], rtol=1e-4, atol=1e-4)


def _left_padded_generate(model, tokenizer):
    rows = ["The cat sat on the mat and looked around.", "Hi!"]
    batch = tokenizer(rows, return_tensors="pt", padding=True, padding_side="left")
    assert int((batch["attention_mask"] == 0).sum()) > 0  # really padded
    out = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out.tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_model_attention_restored_after_kvforge_calls(arch, tokenizer):
    model = tiny_model(arch)
    untouched = copy.deepcopy(model)
    before = model.config._attn_implementation
    engine = Engine(model, tokenizer, chunk_size=8)
    engine.generate("Tell me a story about a boat.", max_new_tokens=4, raw=True)
    engine.generate("Tell me a story about a boat.", max_new_tokens=4, raw=True,
                    press=build_press("snapkv", compression_ratio=0.5, window_size=4))
    assert model.config._attn_implementation == before
    assert all(
        getattr(m, "config", None) is None or m.config._attn_implementation == before
        for m in model.modules()
        if hasattr(getattr(m, "config", None), "_attn_implementation_internal")
    )
    with torch.no_grad():
        assert _left_padded_generate(model, tokenizer) == _left_padded_generate(untouched, tokenizer)
