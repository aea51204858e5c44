"""Decoding-time compression: a cache policy that keeps every layer within a token budget while it generates."""

from __future__ import annotations

import pytest
import torch

from kvforge import compat
from kvforge.cache import KVCache
from kvforge.decode import decode
from kvforge.engine import Engine
from kvforge.prefill import prefill
from kvforge.presses import DecodingPress, build_press
from kvforge.testing import tiny_model, tiny_tokenizer


def _spy_lengths(cache: KVCache) -> list[int]:
    """Record every layer's entries per KV head right after each append (the peak inside a forward)."""
    peaks = [0]

    for layer in cache.layers:
        append = layer.append

        def spy(*args, _append=append, _layer=layer, **kwargs):
            out = _append(*args, **kwargs)
            held = _layer.valid[:, :, : _layer.length].sum(-1).max() if _layer.valid is not None else _layer.length
            peaks[0] = max(peaks[0], int(held))
            return out

        layer.append = spy
    return peaks


@pytest.mark.parametrize(("arch", "prompt", "new", "budget"), [("llama", 2048, 1024, 1024), ("qwen2", 512, 256, 256)])
def test_a_2k_prompt_generating_1024_tokens_never_exceeds_budget_plus_one_step(
    arch: str, prompt: int, new: int, budget: int
) -> None:
    """The bar: budget 1024, a 2,048-token prompt, 1,024 generated tokens: no layer ever holds more than the budget
    plus one step's worth of entries (a step: the interval while decoding, a prefill chunk while prefilling)."""
    model = tiny_model(arch, max_position_embeddings=4096)
    interval, chunk = 16, 64
    cache = KVCache.for_model(model)
    policy = DecodingPress(budget=budget, interval=interval).attach(cache)
    peaks = _spy_lengths(cache)
    ids = torch.randint(3, 120, (1, prompt), generator=torch.Generator().manual_seed(0))
    logits = prefill(model, ids, cache, chunk_size=chunk)
    assert peaks[0] <= budget + interval - 1 + chunk
    assert max(cache.lengths()) <= budget + interval - 1
    prefill_peak, peaks[0] = peaks[0], 0
    out = decode(model, cache, logits, new)  # an int: greedy, exactly `new` tokens (no EOS)
    assert len(out.token_ids) == new
    assert peaks[0] <= budget + interval  # one decoding step appends one entry to at most budget + interval - 1
    assert cache.next_position == prompt + new - 1 and policy.num_compressions > 0
    assert prefill_peak > budget  # the prompt did exceed the budget: the policy cut it while prefilling


def test_cut_keeps_sinks_recent_and_the_most_attended_entries() -> None:
    """A cut keeps the first num_sink positions, the newest `recent` and, among the rest, the entries with the
    largest observed attention; the cache then continues with the same positions (RoPE unchanged)."""
    model = tiny_model("llama")
    cache = KVCache.for_model(model)
    press = DecodingPress(budget=40, interval=8, num_sink=2, recent=6)
    policy = press.attach(cache)
    ids = torch.randint(3, 120, (1, 60), generator=torch.Generator().manual_seed(1))
    with policy.pause():
        prefill(model, ids, cache, chunk_size=None)
    assert max(cache.lengths()) == 60  # paused: nothing cut
    scores = torch.zeros(1, cache.layers[0].keys.shape[1], 60)
    scores[..., 10:42] = torch.linspace(0.1, 0.9, 32)  # entries 10..41 attended, increasing
    policy.scores = [scores.clone() for _ in cache.layers]
    policy.after_forward(cache)
    for layer in cache.layers:
        _, _, pos, valid = layer.view()
        assert valid is None and pos.shape[-1] == 40
        kept = set(pos[0, 0].tolist())
        assert {0, 1} <= kept and set(range(54, 60)) <= kept  # sinks and the 6 newest
        assert kept - {0, 1} - set(range(54, 60)) == set(range(10, 42))  # the 32 most attended
    assert policy.num_compressions == len(cache.layers)


def test_engine_decoding_press_bounds_the_cache_and_matches_full_cache_while_under_budget() -> None:
    """Under the budget nothing is cut: the answer equals the full cache's; over it, the cache stays bounded."""
    model, tok = tiny_model("llama", max_position_embeddings=4096), tiny_tokenizer()
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    full = Engine(model, tok).generate(prompt, max_new_tokens=20)
    roomy_engine = Engine(model, tok, decoding_press=DecodingPress(budget=1000, interval=4))
    roomy = roomy_engine.generate(prompt, max_new_tokens=20)
    assert roomy.token_ids == full.token_ids
    tight = Engine(model, tok, chunk_size=32, decoding_press=DecodingPress(budget=64, interval=4, recent=8))
    gen = tight.generate(prompt, max_new_tokens=40)
    num_layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert len(gen.token_ids) == 40 and gen.info["cache_entries"] <= num_layers * kv_heads * (64 + 4 - 1)


def test_prompt_press_with_kv_budget_keeps_that_many_entries() -> None:
    """--kv-budget: a prompt press keeps a fixed number of entries per layer and KV head instead of a ratio."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    for name in ("snapkv", "knorm", "streaming_llm"):
        for size in (100, 333):
            press = build_press(name, kv_budget=64)
            cache, _ = Engine(model, tok).prefill([3 + i % 100 for i in range(size)], press=press)
            assert cache.lengths() == [64] * len(cache.layers)
    press = build_press("snapkv", kv_budget=500)  # a budget above the prompt keeps everything
    cache, _ = Engine(model, tok).prefill(list(range(3, 103)), press=press)
    assert cache.lengths() == [100] * len(cache.layers)


def test_policy_is_paused_inside_a_press_and_cuts_after() -> None:
    """A cache with a decoding budget compressed by a prompt press: the press sees the whole prompt (KVzip's replay
    included), the policy cuts on the next forward."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    engine = Engine(model, tok, decoding_press=DecodingPress(budget=50, interval=4, recent=8))
    cache, logits = engine.prefill([3 + i % 100 for i in range(200)], press=build_press("kvzip", 0.5))
    assert sum(cache.lengths()) <= 100 * len(cache.layers) * 2  # the press's budget, untouched by the policy
    gen = engine.decode(cache, logits, max_new_tokens=8)
    assert len(gen.token_ids) == 8
    for layer in cache.layers:
        held = layer.valid[:, :, : layer.length].sum(-1).max() if layer.valid is not None else layer.length
        assert int(held) <= 50 + 4 - 1
    assert compat is not None


def test_cli_decode_budget_and_kv_budget(tiny_llama_dir, capsys):
    from kvforge import cli

    base = ["generate", "--model", str(tiny_llama_dir), "--device", "cpu", "--prompt", "hello there " * 20]
    assert cli.main([*base, "--decode-budget", "32", "--decode-interval", "4", "--max-new-tokens", "40"]) == 0
    assert cli.main([*base, "--press", "snapkv", "--kv-budget", "16", "--max-new-tokens", "4"]) == 0
    assert cli.main([*base, "--kv-budget", "16"]) == 2
    assert "needs --press" in capsys.readouterr().err
    assert cli.main([*base, "--decode-budget", "32", "--window", "64"]) == 2
