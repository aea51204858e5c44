"""transformers-native use: ``with press(model): model.generate(...)`` and ``generate(cache=KVCache)``
give what Engine gives on the same input, and the model is exactly as before once the block is left."""

from __future__ import annotations

import copy

import pytest
import torch

from kvforge import compat
from kvforge.cache import KVCache
from kvforge.engine import Engine
from kvforge.errors import UserError
from kvforge.hf import attach
from kvforge.kvzap_train import ensure_trained
from kvforge.prefill import forward, prefill
from kvforge.presses import PRESSES, build_press, compressible_layers, num_kept
from kvforge.testing import ARCHS, tiny_model

S, NEW, CHUNK = 40, 4, 16  # prompt tokens, new tokens, prefill chunk

pytestmark = pytest.mark.usefixtures("one_thread", "calibration_dir", "kvzap_scorers")


@pytest.fixture(scope="module")
def calibration_dir(tmp_path_factory):
    """KVzip head-level calibrations of this module's models go to one temporary folder, never the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVFORGE_CACHE_DIR", str(tmp_path_factory.mktemp("kvforge-cache")))
        yield


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request):
    return tiny_model(request.param)


def ids(n: int = S, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 99, (1, n), generator=torch.Generator().manual_seed(seed))


def small(name: str, ratio: float = 0.5):
    """Registry press with windows and drafts sized for 40-token prompts."""
    for opts in ({"window_size": 8, "lookahead": 2}, {"window_size": 8}, {"lookahead": 2}, {}):
        if "lookahead" in opts and not name.endswith("lookahead"):
            continue
        try:
            return build_press(name, ratio, **opts)
        except UserError:
            continue
    raise AssertionError(name)


def hf_generate(model, input_ids, **kwargs):
    """Greedy model.generate returning (new tokens, per-step logits, the cache it ended on)."""
    out = model.generate(input_ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, **kwargs)  # fmt: skip
    return out.sequences[0, input_ids.shape[1] :].tolist(), torch.cat(out.logits), compat.output_cache(out)


def engine_decode(model, cache, logits):
    """Engine.decode's greedy loop, keeping each step's logits."""
    tokens, steps = [], [logits]
    for _ in range(NEW):
        tokens.append(int(steps[-1].argmax(-1)))
        if len(tokens) < NEW:
            steps.append(forward(model, [[tokens[-1]]], cache)[:, -1])
    return tokens, torch.cat(steps)


def engine(model, tokenizer):
    eng = Engine(model, tokenizer, chunk_size=CHUNK)
    eng.eos_token_ids = []  # decode the full NEW tokens, as generate(eos_token_id=None)
    return eng


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_with_press_generate_equals_engine(model, tokenizer, name):
    press, prompt = small(name), ids()
    cache, logits = engine(model, tokenizer).prefill(prompt[0].tolist(), press=press)
    expected_tokens, expected_logits = engine_decode(model, cache, logits)
    with press(model, tokenizer=tokenizer, chunk_size=CHUNK):
        tokens, got_logits, hf_cache = hf_generate(model, prompt)
    assert tokens == expected_tokens
    torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert isinstance(hf_cache, KVCache) and hf_cache.lengths() == cache.lengths()
    assert hf_cache.next_position == cache.next_position == S + NEW - 1
    assert "forward" not in model.__dict__


def test_snapkv_with_block_keeps_half_the_prompt(tokenizer):
    model = tiny_model("llama")
    with build_press("snapkv", compression_ratio=0.5)(model):
        tokens, _, cache = hf_generate(model, ids())
    assert len(tokens) == NEW
    for i in compressible_layers(cache):  # half of the prompt, plus the fed-back tokens (all but the last)
        assert cache.layers[i].length == num_kept(S, 0.5) + NEW - 1 == S // 2 + NEW - 1
    assert cache.info["press"]["name"] == "snapkv" and cache.next_position == S + NEW - 1


def test_generate_continues_a_compressed_cache_as_engine_decode(model, tokenizer):
    """Plain model.generate (no kvforge block) on a SnapKV-compressed context, then a question and decoding."""
    eng, prompt = engine(model, tokenizer), ids(S + 6)
    cache, _ = eng.prefill(prompt[0, :S].tolist(), press=build_press("snapkv", 0.5, window_size=8))
    ours, logits = eng.prefill(prompt[0, S:].tolist(), copy.deepcopy(cache))
    expected_tokens, expected_logits = engine_decode(model, ours, logits)
    tokens, got_logits, same = hf_generate(model, prompt, **compat.cache_arg(model, cache))
    assert same is cache and tokens == expected_tokens
    torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert cache.next_position == S + 6 + NEW - 1 and cache.lengths() == ours.lengths()


def test_generate_continues_a_reused_segment(tokenizer):
    """A cache loaded from a stored segment continues from its token count (positions exact)."""
    model, prompt = tiny_model("qwen2"), ids(S + 5)
    eng = engine(model, tokenizer)
    full, _ = eng.prefill(prompt[0, :S].tolist())
    segment = full.to_segment("m")
    ours, logits = eng.prefill(prompt[0, S:].tolist(), KVCache.from_segment(segment, model))
    expected_tokens, expected_logits = engine_decode(model, ours, logits)
    tokens, got_logits, _ = hf_generate(model, prompt, **compat.cache_arg(model, KVCache.from_segment(segment, model)))
    assert tokens == expected_tokens
    torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_generate_continues_every_press_cache(model, tokenizer, name):
    """Plain generate continues a compressed cache as Engine does, or refuses one transformers' masks cannot
    describe (head-wise, per-layer budgets), untouched; inside attach() it then equals Engine."""
    eng, prompt = engine(model, tokenizer), ids(S + 6)
    cache, _ = eng.prefill(prompt[0, :S].tolist(), press=small(name))
    ours, logits = eng.prefill(prompt[0, S:].tolist(), copy.deepcopy(cache))
    expected_tokens, expected_logits = engine_decode(model, ours, logits)
    if cache.hf_attention_problem() is not None:
        before = copy.deepcopy(cache)
        with pytest.raises(ValueError, match=r"kvforge\.hf\.attach"):
            hf_generate(model, prompt, **compat.cache_arg(model, cache))
        assert cache.next_position == before.next_position and cache.lengths() == before.lengths()  # rolled back
        with attach(model):
            tokens, got_logits, _ = hf_generate(model, prompt, **compat.cache_arg(model, cache))
    else:
        tokens, got_logits, _ = hf_generate(model, prompt, **compat.cache_arg(model, cache))
    assert tokens == expected_tokens
    torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert cache.lengths() == ours.lengths() and cache.next_position == S + 6 + NEW - 1


def test_which_caches_plain_generate_takes(tokenizer):
    """SnapKV keeps the same count per head: plain; AdaKV pads heads, PyramidKV varies layers: kvforge attention."""
    model = tiny_model("llama", num_hidden_layers=3)
    for name in ("kvzap", "kvzap-mlp"):  # learned scorers: trained once per model, a step of its own
        ensure_trained(small(name), model, tokenizer)
    eng = engine(model, tokenizer)
    problems = {n: eng.prefill(ids()[0].tolist(), press=small(n))[0].hf_attention_problem() for n in PRESSES}
    assert problems["snapkv"] is None and problems["full"] is None
    assert "head-wise" in problems["adakv"] and "different lengths" in problems["pyramidkv"]


def _state(model):
    return (
        dict(model.__dict__.get("_forward_hooks", {})),
        dict(model.__dict__.get("_forward_pre_hooks", {})),
        sorted(k for k in model.__dict__ if not k.startswith("_")),
        type(model).forward,
        model.config._attn_implementation,
        [type(m).forward for m in model.modules()],
        [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_model_exactly_as_before_after_the_block_also_on_error(arch, tokenizer):
    model = tiny_model(arch)
    untouched = copy.deepcopy(model)
    before = _state(model)
    with pytest.raises(RuntimeError, match="boom"), build_press("knorm", 0.5)(model):
        model.generate(ids(), max_new_tokens=2, do_sample=False)
        raise RuntimeError("boom")
    with pytest.raises(UserError, match="batch 1"), build_press("snapkv", 0.5)(model):
        model.generate(torch.cat([ids(), ids(seed=1)]), max_new_tokens=2, do_sample=False)
    assert _state(model) == before and "forward" not in model.__dict__
    for a, b in zip(model.state_dict().values(), untouched.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    batch = torch.cat([ids(), ids(seed=1)])
    mask = torch.ones_like(batch)
    mask[0, :5] = 0  # left padding
    kwargs = {"attention_mask": mask, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(batch, **kwargs), untouched.generate(batch, **kwargs))


def test_clear_errors(tokenizer):
    model = tiny_model("llama")
    for name in ("kvzip", "kvzip-ada", "surrogatekv-kvzip", "kvzip-head"):  # their replay is encoded with it
        with pytest.raises(UserError, match="tokenizer"), build_press(name, 0.5)(model):
            pass
    assert "forward" not in model.__dict__
    cache = KVCache.for_model(model)
    engine(model, tokenizer).prefill(ids()[0].tolist(), cache)
    with attach(model), pytest.raises(UserError, match="already in the cache"):
        model.generate(ids(), **compat.cache_arg(model, cache), max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="num_beams=1"):
        model.generate(ids(S + 2), **compat.cache_arg(model, cache), max_new_tokens=2, num_beams=2, do_sample=False)


def test_generate_on_sliding_window_layers_across_compaction():
    """Gemma3's sliding layers drop old entries in blocks while plain generate runs: masks stay exact."""
    model, prompt = tiny_model("gemma3"), ids(S)
    ours, theirs = (KVCache.for_model(model, block_size=4) for _ in range(2))
    prefill(model, prompt[:, :30], ours)
    prefill(model, prompt[:, :30], theirs)
    expected_tokens, expected_logits = engine_decode(model, ours, prefill(model, prompt[:, 30:], ours, chunk_size=3))
    tokens, got_logits, _ = hf_generate(model, prompt, **compat.cache_arg(model, theirs))
    assert tokens == expected_tokens
    torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert max(theirs.lengths()[:2]) < 30  # the sliding layers really dropped entries


def test_direct_forward_inside_attach_gives_every_logit(tokenizer):
    """model(ids, cache=kv_cache) inside the block returns all positions' logits, as the model would."""
    model, prompt = tiny_model("llama"), ids()
    with torch.no_grad():
        expected = model(prompt).logits
    cache = KVCache.for_model(model)
    with attach(model):
        got = model(prompt[:, :30], **compat.cache_arg(model, cache)).logits
        got = torch.cat([got, model(prompt[:, 30:], **compat.cache_arg(model, cache)).logits], dim=1)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert cache.next_position == S and cache.token_ids == prompt[0].tolist()


def test_press_compresses_new_tokens_on_a_passed_cache(tokenizer):
    """Under a press, tokens prefilled on a KVCache passed in are compressed, its prefix kept: Engine.prefill's rule."""
    model, prompt, press = tiny_model("mistral"), ids(S + 20), build_press("snapkv", 0.5, window_size=8)
    eng = engine(model, tokenizer)
    prefix, _ = eng.prefill(prompt[0, :S].tolist())
    ours, logits = eng.prefill(prompt[0, S:].tolist(), copy.deepcopy(prefix), press=press)
    expected_tokens, expected_logits = engine_decode(model, ours, logits)
    with press(model, chunk_size=CHUNK):
        tokens, got_logits, cache = hf_generate(model, prompt, **compat.cache_arg(model, prefix))
    assert tokens == expected_tokens and cache.lengths() == ours.lengths() == [S + 10 + NEW - 1] * 2
    torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)
