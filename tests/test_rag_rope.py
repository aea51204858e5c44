"""RoPE re-rotation: exact moves of cached keys, refusal of RoPE kinds that cannot move."""

import pytest
import torch

from kvforge.cache import KVCache
from kvforge.prefill import forward
from kvforge.rope import UnsupportedRopeError, rope_spec, rotate_keys
from kvforge.testing import tiny_model

ARCHS = ["llama", "qwen2", "mistral", "gemma3"]


def test_rotate_there_and_back_is_identity():
    torch.manual_seed(0)
    keys = torch.randn(2, 7, 16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    moved = rotate_keys(keys, 1234, inv_freq)
    assert not torch.allclose(moved, keys)
    torch.testing.assert_close(rotate_keys(moved, -1234, inv_freq), keys, atol=1e-5, rtol=1e-5)
    # per-token deltas compose the same way
    delta = torch.arange(7) * 37 - 100
    torch.testing.assert_close(
        rotate_keys(rotate_keys(keys, delta, inv_freq), -delta, inv_freq), keys, atol=1e-5, rtol=1e-5
    )


def test_rotation_composes():
    torch.manual_seed(1)
    keys = torch.randn(3, 5, 8)
    inv_freq = 1.0 / (500 ** (torch.arange(0, 8, 2).float() / 8))
    torch.testing.assert_close(
        rotate_keys(rotate_keys(keys, 10, inv_freq), 25, inv_freq),
        rotate_keys(keys, 35, inv_freq),
        atol=1e-5,
        rtol=1e-5,
    )


def _layer_keys(model, ids, offset):
    cache = KVCache.for_model(model)
    forward(model, ids, cache, position_ids=torch.arange(offset, offset + len(ids))[None])
    return [layer.view()[0][0] for layer in cache.layers]  # (H_kv, S, D) per layer


@pytest.mark.parametrize("arch", ARCHS)
def test_rotated_keys_match_fresh_computation_at_new_positions(arch):
    """Shifting a whole sequence by d only rotates every layer's keys by d (attention is relative)."""
    overrides = {}
    if arch == "gemma3":  # local and global layers with different theta: per-layer frequencies
        overrides = dict(
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        )
    model = tiny_model(arch, **overrides)
    spec = rope_spec(model)
    ids = torch.arange(3, 14).tolist()  # fewer tokens than Gemma3's window: the shift changes nothing else
    old, new = _layer_keys(model, ids, 5), _layer_keys(model, ids, 5 + 40)
    for layer_idx, (k_old, k_new) in enumerate(zip(old, new, strict=True)):
        torch.testing.assert_close(spec.rotate(k_old, 40, layer_idx), k_new, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(spec.rotate(k_new, -40, layer_idx), k_old, atol=1e-4, rtol=1e-4)
    if arch == "gemma3":
        assert not torch.equal(spec.inv_freq[0], spec.inv_freq[2])  # sliding vs full layer differ


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 256,
        },
    ],
)
def test_length_dependent_rope_is_refused(rope_parameters):
    model = tiny_model("llama", rope_parameters=rope_parameters)
    with pytest.raises(UnsupportedRopeError, match=rope_parameters["rope_type"]):
        rope_spec(model)


def test_linear_scaling_is_accepted():
    model = tiny_model("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    assert len(rope_spec(model).inv_freq) == 2


def test_partial_rotary_is_refused():
    model = tiny_model("llama")
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq[:4]  # rotates 8 of 16 dims
    with pytest.raises(UnsupportedRopeError, match="partial rotary"):
        rope_spec(model)


def test_model_without_rope_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    with pytest.raises(UnsupportedRopeError, match="no rotary"):
        rope_spec(model)
