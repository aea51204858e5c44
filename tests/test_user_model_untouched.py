"""kvforge leaves the user's model as it was: after kvforge ran on it, the user's own padded ``model.generate`` gives
the same tokens as on an untouched copy (kvforge attention is switched on only inside kvforge calls)."""

from __future__ import annotations

import copy

import pytest
import torch

from kvforge.engine import Engine
from kvforge.presses import build_press
from kvforge.testing import tiny_model


def _left_padded_generate(model, tokenizer):
    rows = ["The cat sat on the mat and looked around.", "Hi!"]
    batch = tokenizer(rows, return_tensors="pt", padding=True, padding_side="left")
    assert int((batch["attention_mask"] == 0).sum()) > 0  # really padded
    out = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out.tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_generate_unchanged_after_kvforge_ran(arch, tokenizer):
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
