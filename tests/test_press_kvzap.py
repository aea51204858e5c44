"""KVzap: a learned scorer trained on the model's own KVzip+ replay scores, run inside the prefill, no replay."""

from __future__ import annotations

import pytest
import torch

from kvforge import cli
from kvforge.cache import KVCache
from kvforge.errors import UserError
from kvforge.kvzap_train import Recorder, _Gram, ensure_trained, replay_targets, train_kvzap
from kvforge.presses import KVzapModel, build_press, compress_prefill, num_kept
from kvforge.presses.apply import CompressionSource
from kvforge.presses.kvzap import model_path, position_features
from kvforge.presses.kvzip_heads import fingerprint_of
from kvforge.presses.layer import Needs
from kvforge.testing import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse. " * 8


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "kvforge-cache"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A linear and an MLP scorer of a tiny Llama, trained on 3 windows of 128 tokens of the bundled text."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    mlp = train_kvzap(model, tok, kind="mlp", window=128, max_windows=3, epochs=3)
    return model, tok, mlp.linear, mlp


def test_ridge_recovers_a_linear_map_exactly():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(500, 16, generator=gen), torch.randn(3, 16, generator=gen), torch.randn(3, generator=gen)
    gram = _Gram()
    for part in x.split(128):
        gram.add(part, part @ w.T + b)
    got_w, got_b = gram.solve(1e-9)
    torch.testing.assert_close(got_w, w, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b, b, atol=1e-4, rtol=1e-4)


def test_targets_are_log_kvzip_plus_scores_of_the_context(trained):
    """Training pairs: every layer's attention input of each scored entry and the log of KVzip+'s score for it
    (header and sinks, which KVzip always keeps, left out)."""
    model, tok, _, _ = trained
    got = replay_targets(model, tok, TEXT[:300])
    assert sorted(got) == list(range(model.config.num_hidden_layers))
    for x, pos, y in got.values():
        assert x.shape[1] == model.config.hidden_size and y.shape[1] == model.config.num_key_value_heads
        assert x.shape[0] == y.shape[0] == pos.shape[0] > 250 and bool(torch.isfinite(y).all())
        assert bool((y <= 1e-6).all())
        # recency features of the scored entries: the last one is the context's last entry (distance 0)
        torch.testing.assert_close(pos[-1], position_features(1)[0])
        assert bool((pos[:-1, 0] > pos[1:, 0]).all())  # log(1 + distance) falls towards the end


def test_training_info_and_file_round_trip(trained, tmp_path):
    model, tok, linear, mlp = trained
    for scorer in (linear, mlp):
        info = scorer.info
        assert info["windows"] == 2 and info["train_tokens"] > 200 and info["held_out_tokens"] > 100
        assert -1 <= info["validation"]["corr"] <= 1 and 0 <= info["validation"]["kept_overlap_25"] <= 1
        path = tmp_path / f"{scorer.kind}.safetensors"
        scorer.save(path)
        back = KVzapModel.load(path, fingerprint_of(model, tok))
        assert back.kind == scorer.kind and back.info == info
        for a, b in zip(scorer.layers, back.layers, strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert path.stat().st_size < 100_000  # a small shippable file
    with pytest.raises(UserError, match="trained for model"):
        KVzapModel.load(tmp_path / "linear.safetensors", fingerprint_of(tiny_model("qwen2"), tok))
    (tmp_path / "junk.safetensors").write_bytes(b"not a model")
    with pytest.raises(UserError, match="cannot read"):
        KVzapModel.load(tmp_path / "junk.safetensors")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_press_scores_are_the_model_applied_to_the_prefill_hidden_states(trained, tmp_path, kind):
    """The scores the press ranks are exactly the trained map of each layer's attention input, computed chunk by chunk
    inside the prefill, plus the recency term of the entries' distance from the last one; the budget is KVzip's (one
    top-k over the model), header and sinks kept."""
    model, tok, linear, mlp = trained
    path = tmp_path / "scorer.safetensors"
    (linear if kind == "linear" else mlp).save(path)
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :200]
    press = build_press("kvzap", 0.75, kind=kind, model=str(path))
    recorder = Recorder()
    source = CompressionSource(model, ids, KVCache.for_model(model), press.needs().merge(Needs(scorers=(recorder,))),
                               chunk_size=64, tokenizer=tok)  # fmt: skip
    for ctx in source.contexts(press):
        hidden = torch.cat(recorder.hidden[ctx.model_layer])[None]
        want = press.scorer.model.predict(ctx.model_layer, hidden)
        want = want + press.scorer.model.layers[ctx.model_layer]["wp"] @ position_features(ctx.size).T
        torch.testing.assert_close(ctx.hidden_scores[press.scorer.key], want, atol=1e-5, rtol=1e-5)
    cache = source.compress(press)
    kept = cache.info["press"]["kept_entries_per_layer"]
    assert sum(kept) == model.config.num_hidden_layers * model.config.num_key_value_heads * num_kept(200, 0.75)
    for layer in cache.layers:
        _, _, pos, valid = layer.view()
        held = pos.masked_fill(~valid, -1) if valid is not None else pos
        assert all(bool((held[0, h] == p).any()) for h in range(held.shape[1]) for p in range(4))  # sinks kept


def test_position_features_and_the_recency_term_in_the_score(trained, tmp_path):
    """The press ranks the hidden-state prediction plus the trained per-layer, per-head recency term of each entry's
    distance from the last new entry (also for a second press that reuses the first one's scores); a file without
    that term ranks the prediction alone."""
    feats = position_features(5)
    d = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    torch.testing.assert_close(feats[:, 0], torch.log1p(d))
    torch.testing.assert_close(feats[:, 1:], torch.stack([torch.exp(-d / s) for s in (64.0, 256.0, 1024.0)], 1))
    model, tok, linear, _ = trained
    assert all(p is None or p["wp"].shape == (model.config.num_key_value_heads, 4) for p in linear.layers)
    assert any(float(p["wp"].abs().max()) > 0 for p in linear.layers if p is not None)
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :120]
    for with_recency in (True, False):
        layers = [None if p is None else {k: v for k, v in p.items() if with_recency or k != "wp"}
                  for p in linear.layers]
        scorer = KVzapModel(linear.kind, linear.fingerprint, layers)
        path = tmp_path / f"scorer-{with_recency}.safetensors"
        scorer.save(path)
        press, other = build_press("kvzap", 0.75, model=str(path)), build_press("kvzap", 0.5, model=str(path))
        recorder = Recorder()
        needs = press.needs().merge(Needs(scorers=(recorder,)))
        source = CompressionSource(model, ids, KVCache.for_model(model), needs, chunk_size=64, tokenizer=tok)
        for ctx in source.contexts(press):
            want = scorer.predict(ctx.model_layer, torch.cat(recorder.hidden[ctx.model_layer])[None])
            if with_recency:
                want = want + scorer.layers[ctx.model_layer]["wp"] @ position_features(ctx.size).T
            for p in (press, other):  # ``other`` was never bound: the scores are the bound scorer's
                got = p.score(ctx)
                free = torch.isfinite(got)
                assert int(free.sum()) > 0
                torch.testing.assert_close(got[free], want.expand_as(got)[free], atol=1e-5, rtol=1e-5)


def test_scoring_runs_no_extra_forward(trained, tmp_path):
    """KVzap's cost is a matmul per layer and chunk: the model runs exactly the prefill's forwards (no replay)."""
    model, tok, linear, _ = trained
    path = tmp_path / "scorer.safetensors"
    linear.save(path)
    calls = []
    handle = model.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        ids = tok(TEXT, return_tensors="pt").input_ids[:, :200]
        compress_prefill(model, ids, KVCache.for_model(model), build_press("kvzap", 0.5, model=str(path)),
                         chunk_size=64, tokenizer=tok)  # fmt: skip
        assert len(calls) == 4  # 200 tokens in chunks of 64
        calls.clear()
        compress_prefill(model, ids, KVCache.for_model(model), build_press("kvzip", 0.5), chunk_size=64, tokenizer=tok)
        assert len(calls) > 4  # KVzip replays the context
    finally:
        handle.remove()


def test_first_use_trains_once_as_a_step_of_its_own_and_caches_by_fingerprint(tmp_path):
    """A press without a trained file says how to train one (a press never trains); ``ensure_trained`` trains once
    on the bundled text and saves under the model's fingerprint; the press then loads it, and nothing trains again."""
    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :150]
    with pytest.raises(UserError, match="kvforge presses train"):
        compress_prefill(model, ids, KVCache.for_model(model), build_press("kvzap", 0.5), tokenizer=tok)
    ensure_trained(build_press("kvzap", 0.5), model, tok)
    path = model_path(fingerprint_of(model, tok), "linear")
    assert path.exists()
    stamp = path.stat().st_mtime_ns
    ensure_trained(build_press("kvzap", 0.5), model, tok)
    compress_prefill(model, ids, KVCache.for_model(model), build_press("kvzap", 0.5), tokenizer=tok)
    assert path.stat().st_mtime_ns == stamp  # loaded, not trained again
    with pytest.raises(UserError, match="tokenizer"):
        ensure_trained(build_press("kvzap-mlp", 0.5), model, None)


def test_presses_train_cli(tiny_llama_dir, tmp_path, capsys):
    text = tmp_path / "train.txt"
    text.write_text(TEXT * 3)
    out = tmp_path / "scorer.safetensors"
    argv = ["presses", "train", "--model", str(tiny_llama_dir), "--device", "cpu", "--data", str(text),
            "--window", "128", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    assert out.exists() and "held-out document" in capsys.readouterr().out
    assert KVzapModel.load(out).info["texts"] == ["train.txt"]
    assert cli.main(["presses", "train", "--model", str(tiny_llama_dir), "--data", str(tmp_path / "missing.txt")]) == 2


def test_a_file_of_the_older_format_loads_with_a_warning(trained, tmp_path, monkeypatch, caplog):
    """Files written before the recency term still load (ranked by the prediction alone) and say how to renew them;
    the first-use cache name changed with the format, so an old auto-trained file is trained again, not reused."""
    from kvforge.presses import kvzap

    linear = trained[2]
    path = tmp_path / "old.safetensors"
    old = KVzapModel(linear.kind, linear.fingerprint, [None if p is None else {k: v for k, v in p.items() if k != "wp"}
                                                       for p in linear.layers])  # fmt: skip
    monkeypatch.setattr(kvzap, "FORMAT", "kvforge-kvzap/1")
    old.save(path)
    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="kvforge.presses.kvzap"):
        back = KVzapModel.load(path, linear.fingerprint)
    assert "no recency term" in caplog.text and back.position_term(0, 10, torch.device("cpu")) is None
    assert model_path("fp", "linear").name == "fp-linear-v2.safetensors"
