"""compress_prefill on tiny models of every architecture: exactness at ratio 0, budgets, hooks, decoding."""

from __future__ import annotations

import pytest
import torch

from kvforge.cache import KVCache
from kvforge.errors import UserError
from kvforge.prefill import forward, prefill
from kvforge.presses import PRESSES, Press, SnapKVPress, build_press, compress_prefill, compressible_layers, num_kept
from kvforge.presses.hooks import attention_modules
from kvforge.testing import ARCHS, tiny_model, tiny_tokenizer

S, CHUNK = 150, 64


pytestmark = pytest.mark.usefixtures("one_thread", "kvzap_scorers")  # tiny tensors: one thread is faster


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    """KVzip head-level calibrations go to a temporary cache dir, never the user's."""
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "kvforge-cache"))


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def ids(n: int = S, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 99, (1, n), generator=torch.Generator().manual_seed(seed))


def small(name: str, ratio: float) -> Press:
    """Registry press with windows sized for 150-token prompts."""
    opts = {"window_size": 16} if "window_size" in _options(name) else {}
    if "lookahead" in _options(name) and name.endswith("lookahead"):
        opts["lookahead"] = 3
    return build_press(name, ratio, **opts)


def _tok(name: str):
    """The tokenizer a press needs (KVzap trains its scorer on text the first time): None for the others."""
    return tiny_tokenizer() if name.startswith("kvzap") else None


def _options(name: str) -> set[str]:
    try:
        build_press(name, 0.0, window_size=16)
        return {"window_size", "lookahead"}
    except UserError:
        return {"lookahead"}


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_ratio_zero_changes_no_logit(model, name):
    prompt, question = ids(), ids(7, seed=1)
    ref_cache = KVCache.for_model(model)
    ref = prefill(model, prompt, ref_cache, chunk_size=CHUNK)
    ref_next = forward(model, question, ref_cache, logits_to_keep=7)
    cache = KVCache.for_model(model)
    logits = compress_prefill(model, prompt, cache, small(name, 0.0), chunk_size=CHUNK, tokenizer=_tok(name))
    assert torch.equal(logits, ref)
    assert torch.equal(forward(model, question, cache, logits_to_keep=7), ref_next)


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_compressed_cache_decodes_on_every_arch(model, name):
    cache = KVCache.for_model(model)
    logits = compress_prefill(model, ids(), cache, small(name, 0.5), chunk_size=CHUNK, tokenizer=_tok(name))
    assert cache.next_position == S and len(cache.token_ids) == S
    for _ in range(3):
        logits = forward(model, logits.argmax(-1, keepdim=True), cache)[:, -1]
        assert torch.isfinite(logits).all()
    assert cache.next_position == S + 3
    info = cache.info["press"]
    assert info["name"] == name and info["compressed_tokens"] == S
    h_kv = model.config.num_key_value_heads
    layers = compressible_layers(KVCache.for_model(model))
    want = S if name == "full" else num_kept(S, 0.5)
    kept = [info["kept_entries_per_layer"][i] for i in layers]
    if name in ("pyramidkv", "kvzip", "kvzip-global", "kvzip-plus", "kvzap", "kvzap-mlp"):  # model-wide budgets
        assert sum(kept) == h_kv * want * len(layers)
    else:
        assert kept == [h_kv * want] * len(layers)


@pytest.mark.parametrize(
    "name", ["streaming_llm", "snapkv", "h2o", "criticalkv", "surrogatekv-local", "knorm", "expected_attention"]
)
@pytest.mark.parametrize("n, ratio", [(100, 0.3), (150, 0.75), (230, 0.9)])
def test_exact_kept_count_per_layer_and_head(llama, name, n, ratio):
    cache = KVCache.for_model(llama)
    compress_prefill(llama, ids(n), cache, small(name, ratio), chunk_size=CHUNK)
    for layer in cache.layers:
        _, _, _, valid = layer.view()
        assert valid is None and layer.length == num_kept(n, ratio)


@pytest.mark.parametrize(
    "name", ["adakv", "criticaladakv", "surrogatekv-ada", "kvzip-ada", "kvzip-layer", "kvzip-head"]
)
@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_headwise_layer_totals_exact_and_memory_freed(llama, name, ratio):
    n = 200
    full = KVCache.for_model(llama)
    prefill(llama, ids(n), full, chunk_size=CHUNK)
    cache = KVCache.for_model(llama)
    compress_prefill(llama, ids(n), cache, small(name, ratio), chunk_size=CHUNK)
    h_kv = llama.config.num_key_value_heads
    for layer in cache.layers:
        assert layer.num_entries() == h_kv * num_kept(n, ratio)
    assert cache.nbytes() < full.nbytes()
    assert cache.info["press"]["nbytes"] == cache.nbytes()


def test_pyramidkv_layers_hold_different_lengths_and_same_total(llama):
    n, ratio = 600, 0.5  # 2 layers: budgets differ once S(1-r)/beta >= window
    cache = KVCache.for_model(llama)
    compress_prefill(llama, ids(n), cache, build_press("pyramidkv", ratio, window_size=8, beta=2.0), chunk_size=256)
    lengths = cache.lengths()
    assert lengths[0] > lengths[1] and sum(lengths) == 2 * num_kept(n, ratio)
    assert torch.isfinite(forward(llama, ids(4), cache)).all()


def test_reused_prefix_is_kept_as_is(llama):
    prefix, rest = ids(60, seed=3), ids(120, seed=4)
    cache = KVCache.for_model(llama)
    prefill(llama, prefix, cache)
    before = [layer.view()[0][:, :, :60].clone() for layer in cache.layers]
    compress_prefill(llama, rest, cache, small("snapkv", 0.75), chunk_size=CHUNK)
    for layer, keys in zip(cache.layers, before, strict=True):
        assert layer.length == 60 + num_kept(120, 0.75)
        assert torch.equal(layer.view()[0][:, :, :60], keys)
        assert layer.view()[2][0, 0, :60].tolist() == list(range(60))
    assert cache.next_position == 180


def test_all_sliding_layers_warn_and_keep_everything(caplog):
    model = tiny_model("mistral", sliding_window=8)
    cache = KVCache.for_model(model)
    with caplog.at_level("WARNING", logger="kvforge.presses.apply"):
        compress_prefill(model, ids(40, seed=5), cache, small("snapkv", 0.75), chunk_size=CHUNK)
    assert "every layer has a sliding window: snapkv compresses nothing" in caplog.text
    assert cache.info["press"]["uncompressed_layers"] == list(range(cache.num_layers))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lookahead_and_reconstruction_are_undone(arch):
    model = tiny_model(arch)
    for press in (build_press("snapkv-lookahead", 0.5, window_size=16, lookahead=4), build_press("kvzip", 0.5)):
        cache, plain = KVCache.for_model(model), KVCache.for_model(model)
        compress_prefill(model, ids(), cache, press, chunk_size=CHUNK)
        prefill(model, ids(), plain, chunk_size=CHUNK)
        assert cache.next_position == S and cache.token_ids == plain.token_ids
        for i in range(cache.num_layers):
            if i not in compressible_layers(cache):  # sliding layers: untouched by drafts and replay
                assert torch.equal(cache.layers[i].view()[0], plain.layers[i].view()[0])
            assert int(cache.layers[i].view()[2].max()) < S  # no draft or replay entry left


def test_lookahead_changes_the_selection(llama):
    sel = []
    for look in (0, 6):
        cache = KVCache.for_model(llama)
        compress_prefill(llama, ids(), cache, SnapKVPress(compression_ratio=0.75, window_size=4, lookahead=look))
        sel.append(cache.layers[1].view()[2])
    assert not torch.equal(sel[0], sel[1])


def _num_hooks(model) -> int:
    return sum(len(m._forward_hooks) for m in attention_modules(model))


def test_hooks_removed_after_use_and_on_error(llama):
    assert _num_hooks(llama) == 0
    compress_prefill(llama, ids(), KVCache.for_model(llama), small("snapkv-lookahead", 0.5))
    assert _num_hooks(llama) == 0
    bad = ids()
    bad[0, 100] = 10_000  # out of vocabulary: the forward fails inside the hooked prefill
    with pytest.raises(IndexError):
        compress_prefill(llama, bad, KVCache.for_model(llama), small("snapkv", 0.5), chunk_size=CHUNK)
    assert _num_hooks(llama) == 0


def test_build_press_errors():
    with pytest.raises(UserError, match="snapkv"):
        build_press("snapkvv", 0.5)
    with pytest.raises(UserError, match=r"\[0, 1\)"):
        build_press("snapkv", 1.0)
    with pytest.raises(UserError, match="window_size"):
        build_press("snapkv", 0.5, windw_size=3)
    with pytest.raises(UserError):
        build_press("surrogatekv-local", 0.5, chunk_size=1)
    assert build_press("criticaladakv", 0.25, window_size=8).press.window_size == 8


def test_press_options_in_the_name_build_the_same_press():
    assert build_press("kvzip:pool=3:budget=layer", 0.75) == build_press("kvzip", 0.75, pool=3, budget="layer")
    assert build_press("kvzip:pool=3", 0.75).registry_name == "kvzip:pool=3"
    inner = build_press("criticaladakv:window_size=8:alpha_safeguard=0.3", 0.25)  # a wrapper: outer and inner fields
    assert (inner.press.window_size, inner.alpha_safeguard) == (8, 0.3)
    assert build_press("kvzip-layer:pool=3", 0.5).budget == "layer"  # the registered defaults stay under the options
    assert build_press("kvzip-layer:budget=global", 0.5).budget == "global"
    with pytest.raises(UserError, match="given in the name and as a keyword"):
        build_press("kvzip:pool=3", 0.5, pool=5)
    with pytest.raises(UserError, match="no option poo; valid: budget"):
        build_press("kvzip:poo=3", 0.5)
    with pytest.raises(UserError, match=r"pool must be 0 \(off\) or an odd window"):
        build_press("kvzip:pool=4", 0.5)  # the press's own check, named with the spec
    for spec, kind in (("kvzip:pool=3.5", "a whole number"), ("kvzip:keep_header=1", "true or false"),
                       ("kvzip:budget=3", "a word"), ("adakv:alpha_safeguard=low", "a number")):  # fmt: skip
        with pytest.raises(UserError, match=f"must be {kind}"):
            build_press(spec, 0.5)


def test_presses_command_lists_a_press_options(capsys):
    from kvforge.cli import main

    assert main(["presses", "--options", "kvzip-layer:pool=3"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["pool"] == ["3", "KVzipPress"] and rows["budget"] == ["'layer'", "KVzipPress"]
    assert main(["presses", "--options", "adakv"]) == 0
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()}
    assert rows["alpha_safeguard"] == "AdaKVPress" and rows["window_size"] == "SnapKVPress"
    assert main(["presses", "--options", "kvzp"]) == 2


def test_presses_command_lists_every_name(capsys):
    from kvforge.cli import main
    from kvforge.presses import DESCRIPTIONS

    assert set(DESCRIPTIONS) == set(PRESSES)
    assert main(["presses"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(PRESSES)


def test_compress_on_top_of_a_headwise_compressed_prefix(llama):
    cache = KVCache.for_model(llama)
    compress_prefill(llama, ids(120, seed=5), cache, small("adakv", 0.5), chunk_size=CHUNK)
    held = [layer.num_entries() for layer in cache.layers]
    compress_prefill(llama, ids(100, seed=6), cache, small("snapkv", 0.75), chunk_size=CHUNK)
    h_kv = llama.config.num_key_value_heads
    assert [layer.num_entries() for layer in cache.layers] == [n + h_kv * num_kept(100, 0.75) for n in held]
    assert cache.next_position == 220
    assert torch.isfinite(forward(llama, ids(3), cache)).all()


def _layer_state(cache: KVCache) -> list[tuple]:
    return [tuple(None if t is None else t.clone() for t in layer.view()) for layer in cache.layers]


def _assert_same_cache(a: KVCache, b: KVCache) -> None:
    assert a.next_position == b.next_position and a.token_ids == b.token_ids
    for la, lb in zip(_layer_state(a), _layer_state(b), strict=True):
        for ta, tb in zip(la, lb, strict=True):
            assert (ta is None) == (tb is None)
            if ta is not None:
                assert torch.equal(ta, tb)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_one_source_compressed_by_many_presses_equals_separate_prefills(arch):
    """CompressionSource: one prefill, any press, any order -> exactly compress_prefill's cache and logits."""
    from kvforge.presses import CompressionSource, Needs

    model = tiny_model(arch)
    presses = [small(n, r) for n, r in [("snapkv", 0.5), ("pyramidkv", 0.75), ("adakv", 0.5), ("criticalkv", 0.5),
               ("surrogatekv-global", 0.75), ("streaming_llm", 0.5), ("h2o", 0.5), ("snapkv-lookahead", 0.5),
               ("kvzip", 0.5)]]  # fmt: skip
    presses.append(SnapKVPress(compression_ratio=0.5, window_size=8, lookahead=2))  # smaller window, fewer drafts
    needs = Needs()
    for p in presses:
        needs = needs.merge(p.needs())
    prompt = ids()
    plain = KVCache.for_model(model)
    plain_logits = prefill(model, prompt, plain, chunk_size=None)
    source = CompressionSource(model, prompt, KVCache.for_model(model), needs, chunk_size=None)
    for press in presses + presses[:2]:  # re-compressing after other presses changes nothing
        ref = KVCache.for_model(model)
        ref_logits = compress_prefill(model, prompt, ref, press, chunk_size=None)
        got = source.compress(press)
        assert torch.equal(source.logits, ref_logits)
        _assert_same_cache(got, ref)
        assert got.info["press"]["kept_entries_per_layer"] == ref.info["press"]["kept_entries_per_layer"]
        # decoding on the compressed cache then restoring leaves the full prefill intact
        forward(model, torch.tensor([[5, 6, 7]]), got)
    _assert_same_cache(source.restore(), plain)
    assert torch.equal(source.logits, plain_logits)


def test_source_refuses_a_press_needing_more_than_collected(llama):
    from kvforge.presses import CompressionSource, Needs

    source = CompressionSource(llama, ids(), KVCache.for_model(llama), Needs(window_size=8), chunk_size=CHUNK)
    with pytest.raises(ValueError, match="window of 16"):
        source.compress(small("snapkv", 0.5))
    with pytest.raises(ValueError, match="lookahead"):
        source.compress(SnapKVPress(compression_ratio=0.5, window_size=8, lookahead=2))
    source.compress(SnapKVPress(compression_ratio=0.5, window_size=8))  # fits
