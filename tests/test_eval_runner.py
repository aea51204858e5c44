import argparse
import json

import pytest
import torch

from kvforge.cache import KVCache
from kvforge.commands import eval as eval_cmd
from kvforge.engine import Engine
from kvforge.errors import UserError
from kvforge.eval import fidelity
from kvforge.eval.data import Example, write_examples
from kvforge.eval.runner import EvalRunner, Prefilled, Trial, press_trials
from kvforge.prefill import forward
from kvforge.testing import tiny_model, tiny_tokenizer


def keep_even(cache):
    """A fake press: keep the even positions of every layer (half the cache)."""
    for layer in cache.layers:
        k, v, p, _ = layer.view()
        keep = (p[0, 0] % 2 == 0).nonzero().flatten()
        layer.replace(k[:, :, keep].clone(), v[:, :, keep].clone(), p[:, :, keep].clone())


def fake_trial(calls=None):
    def run(engine, example):
        if calls is not None:
            calls.append(example.id)
        ctx, q = engine.encode_qa(example.context, example.question, answer_prefix=example.answer_prefix)
        cache, logits = engine.prefill(ctx + q)
        keep_even(cache)
        return Prefilled(cache, logits, 0.001, ctx + q)

    return Trial("even", 0.5, run)


def counted(trial, calls):
    def run(engine, example):
        calls.append((example.id, trial.method))
        return trial.prefill(engine, example)

    return Trial(trial.method, trial.compression_ratio, run)


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model("llama"), tiny_tokenizer(), chunk_size=64)


def _examples():
    hay = "The quick brown fox jumps over the lazy dog. " * 3
    return [
        Example(id="n1", context=hay + "The code is 4242. " + hay, question="What is the code?", answers=["4242"],
                task="needle", max_new_tokens=4, answer_prefix="The code is", needles=["The code is 4242."]),
        Example(id="q1", context="Paris is the capital of France.", question="Capital of France?", answers=["Paris"],
                metric="f1", task="qa", max_new_tokens=3),
    ]  # fmt: skip


def test_end_to_end_writes_all_files_and_resumes(tmp_path, engine):
    from kvforge.eval.report import write_all

    calls = []
    trials = [counted(press_trials(["full"], [0.5])[0], calls), counted(fake_trial(), calls)]
    runner = EvalRunner(engine, trials, tmp_path, {"model": "tiny", "mode": "query-aware"}, with_fidelity=True)
    rows = runner.run(_examples(), progress=False)
    assert len(rows) == 4 and len(calls) == 4
    by = {(r["id"], r["method"]): r for r in rows}
    full, even = by[("n1", "full")], by[("n1", "even")]
    assert full["kept_ratio"] == 1.0 and full["compression_ratio"] == 0.0
    assert even["kept_ratio"] == pytest.approx(0.5, abs=0.01)
    assert even["cache_bytes"] < full["cache_bytes"]
    assert full["kl"] == pytest.approx(0.0, abs=1e-6) and full["top1_agreement"] == 1.0
    assert full["needle_kept"] == 1.0 and 0.4 < even["needle_kept"] < 0.6
    assert even["kl"] > 0
    for r in rows:
        assert set(r) >= {"prediction", "score", "ttft_s", "cache_bytes", "kept_ratio", "peak_memory_bytes"}
    summary = write_all(tmp_path, rows, "tiny", "query-aware")
    for name in ["results.jsonl", "summary.json", "summary.csv", "score_vs_cache.png", "ttft.png", "report.md",
                 "kl_vs_cache.png", "run.json"]:  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0, name
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert {"model", "mode", "rows"} <= set(saved)
    full_rows = [r for r in saved["rows"] if r["method"] == "full"]
    assert all(r["normalized"] in (None, 100.0) for r in full_rows)
    assert {"all", "needle", "qa"} == {r["task"] for r in saved["rows"]}

    # a second run does no new work; a torn last line is redone
    calls.clear()
    assert len(runner.run(_examples(), progress=False)) == 4 and calls == []
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10])
    rows = runner.run(_examples(), progress=False)
    assert sorted(calls) == [("q1", "even"), ("q1", "full")]  # full re-run: fidelity reference of the missing row
    assert sorted((r["id"], r["method"]) for r in rows) == sorted(by)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4


def test_full_runs_once_per_example_across_ratios(tmp_path, engine):
    calls = []
    trials = [counted(press_trials(["full"], [0.5])[0], calls)]
    for ratio in (0.25, 0.5, 0.75):
        trials.append(counted(Trial("even", ratio, fake_trial().prefill), calls))
    EvalRunner(engine, trials, tmp_path, {"model": "tiny"}).run(_examples(), progress=False)
    assert sum(c[1] == "full" for c in calls) == 2  # once per example, not once per ratio
    assert len(calls) == 8


def test_rerun_with_other_settings_is_refused(tmp_path, engine):
    trials = press_trials(["full"], [0.5])
    EvalRunner(engine, trials, tmp_path, {"model": "tiny", "mode": "query-aware"}).run(_examples()[:1], progress=False)
    with pytest.raises(UserError, match="other settings"):
        EvalRunner(engine, trials, tmp_path, {"model": "tiny", "mode": "query-agnostic"}).run(_examples())
    with pytest.raises(ValueError, match="full cache"):
        EvalRunner(engine, [fake_trial()], tmp_path, {})


def test_teacher_forcing_leaves_cache_unchanged(engine):
    ids = engine.tokenizer("Some context here and a question?", add_special_tokens=False)["input_ids"]
    cache, logits = engine.prefill(ids)
    before = [t.clone() for t in cache.layers[0].view()[:3]]
    cont = engine.tokenizer(" an answer", add_special_tokens=False)["input_ids"]
    lp = fidelity.teacher_forced_logprobs(engine.model, cache, logits, cont)
    assert lp.shape == (len(cont), engine.model.config.vocab_size)
    assert cache.next_position == len(ids) and cache.layers[0].length == len(ids)
    for a, b in zip(before, cache.layers[0].view()[:3], strict=True):
        assert torch.equal(a, b)
    # teacher forcing equals a plain forward over prompt + continuation
    full = forward(engine.model, ids + cont[:-1], KVCache.for_model(engine.model), logits_to_keep=len(cont))
    torch.testing.assert_close(lp, torch.log_softmax(full[0].float(), -1), atol=1e-4, rtol=1e-4)
    m = fidelity.fidelity_metrics(lp, lp, cont)
    assert m["kl"] == pytest.approx(0.0, abs=1e-6) and m["top1_agreement"] == 1.0
    assert m["answer_nll"] == pytest.approx(-float(lp[torch.arange(len(cont)), cont].mean()))


def test_needle_positions_map_to_prompt_tokens(engine):
    tok = engine.tokenizer
    ids = tok("<u>abc NEEDLE def\n", add_special_tokens=False)["input_ids"]
    assert fidelity.needle_positions(tok, ids, ["NEEDLE"]) == list(range(7, 13))
    cache, _ = engine.prefill(ids)
    assert fidelity.needle_kept(cache, list(range(7, 13))) == 1.0
    keep_even(cache)
    assert fidelity.needle_kept(cache, list(range(7, 13))) == 0.5
    ctx, q = engine.encode_qa("abc NEEDLE def", "Where?")
    assert fidelity.needle_positions(tok, ctx + q, ["NEEDLE"]) == [
        ctx.index(tok.convert_tokens_to_ids("N")) + i for i in range(6)
    ]
    assert fidelity.needle_kept(cache, []) is None


def _parse(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    eval_cmd.register(sub, None)
    return parser.parse_args(["eval", *argv])


def test_cli_malformed_input_fails_before_loading_the_model(tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "context": "c", "question": "q", "answers": ["a"]}\n{"id": "b", "context": 1}\n')
    monkeypatch.setattr(eval_cmd, "load_engine", lambda args: pytest.fail("model loaded"))
    args = _parse(["--model", "x", "--data", str(bad), "--out", str(tmp_path / "o")])
    with pytest.raises(UserError, match=rf"{bad}:2: "):
        args.func(args)
    with pytest.raises(SystemExit):
        _parse(["--model", "x", "--data", str(bad), "--task", "needle", "--out", "o"])
    args = _parse(["--model", "x", "--data", str(bad), "--out", "o", "--compression-ratios", "0.5,1.0"])
    with pytest.raises(UserError, match="compression-ratios"):
        args.func(args)


def test_cli_end_to_end_on_jsonl(tmp_path, monkeypatch, engine, capsys):
    data = write_examples(_examples(), tmp_path / "in.jsonl")
    monkeypatch.setattr(eval_cmd, "load_engine", lambda args: engine)
    out = tmp_path / "out"
    args = _parse(["--model", "tiny", "--data", str(data), "--methods", "full", "--out", str(out), "--fidelity",
                   "--no-progress", "--max-new-tokens", "2"])  # fmt: skip
    assert args.func(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(1 <= r["new_tokens"] <= 2 for r in rows)
    assert (out / "report.md").read_text().startswith("# kvforge eval: tiny")
    assert "wrote" in capsys.readouterr().out


def test_run_json_records_provenance_and_refuses_a_changed_resume(tmp_path, monkeypatch, engine):
    data = write_examples(_examples(), tmp_path / "in.jsonl")
    monkeypatch.setattr(eval_cmd, "load_engine", lambda args: engine)
    out = tmp_path / "out"
    common = ["--model", "tiny", "--data", str(data), "--out", str(out), "--no-progress"]
    args = _parse([*common, "--methods", "full", "--max-new-tokens", "2"])
    assert args.func(args) == 0
    info = json.loads((out / "run.json").read_text())
    settings, (first,) = info["settings"], info["runs"]
    assert settings["max_new_tokens"] == 2 and settings["chunk_size"] == 512 and settings["model_id"] == engine.model_id
    assert settings["device"] == "cpu" and settings["dtype"] == "float32" and settings["data"] == str(data.resolve())
    assert settings["mode"] == "query-aware" and settings["fidelity"] is False
    assert {"kvforge", "git_sha", "torch", "transformers", "python", "command"} <= set(first)
    for option, value, old in (("--max-new-tokens", "3", "2"), ("--chunk-size", "64", "512")):
        argv = ["--max-new-tokens", "2", option, value] if option != "--max-new-tokens" else [option, value]
        args = _parse([*common, "--methods", "full", *argv])
        with pytest.raises(UserError, match=f"{option} was {old}, now {value}"):
            args.func(args)
    with pytest.raises(UserError, match="--query-agnostic was 'query-aware', now 'query-agnostic'"):
        args = _parse([*common, "--methods", "full", "--max-new-tokens", "2", "--query-agnostic"])
        args.func(args)
    rows = (out / "results.jsonl").read_text()
    args = _parse([*common, "--methods", "full,snapkv", "--compression-ratios", "0.5", "--max-new-tokens", "2"])
    assert args.func(args) == 0  # same settings, more methods: a resume adds rows
    assert (out / "results.jsonl").read_text().startswith(rows)
    assert len(json.loads((out / "run.json").read_text())["runs"]) == 1  # same code and command: one entry


def test_a_run_json_of_kvforge_0_1_0_still_resumes(tmp_path, monkeypatch, engine):
    data = write_examples(_examples()[:1], tmp_path / "in.jsonl")
    monkeypatch.setattr(eval_cmd, "load_engine", lambda args: engine)
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"model": "tiny", "mode": "query-aware", "fidelity": False}))
    common = ["--model", "tiny", "--data", str(data), "--out", str(out), "--no-progress", "--methods", "full"]
    with pytest.raises(UserError, match="--fidelity was False, now True"):
        args = _parse([*common, "--fidelity"])
        args.func(args)
    args = _parse(common)
    assert args.func(args) == 0
    assert json.loads((out / "run.json").read_text())["settings"]["model_id"] == engine.model_id


def test_cli_tasks_interleave_and_report_only(tmp_path, monkeypatch, engine, capsys):
    hay = tmp_path / "hay.txt"
    hay.write_text("Once upon a time there was a fox. It ran far away. The end came soon. " * 40)
    monkeypatch.setattr(eval_cmd, "load_engine", lambda args: engine)
    out = tmp_path / "out"
    common = ["--model", "tiny", "--out", str(out), "--no-progress"]
    args = _parse([*common, "--task", "needle,ruler-vt", "--haystack", str(hay), "--lengths", "160", "--depths",
                   "0.5", "--methods", "full", "--max-new-tokens", "1", "--limit", "2"])  # fmt: skip
    assert args.func(args) == 0
    assert [json.loads(x)["task"] for x in (out / "examples.jsonl").read_text().splitlines()] == ["needle", "ruler-vt"]
    (out / "report.md").unlink()
    args = _parse([*common, "--task", "needle", "--report-only"])
    assert args.func(args) == 0
    assert (out / "report.md").is_file()
    with pytest.raises(UserError, match="no results"):
        args = _parse(["--model", "x", "--out", str(tmp_path / "empty"), "--task", "needle", "--report-only"])
        args.func(args)


PRESS_METHODS = ["streaming_llm", "h2o", "snapkv", "pyramidkv", "adakv", "criticalkv", "criticaladakv",
                 "surrogatekv-null", "surrogatekv-local", "surrogatekv-global"]  # fmt: skip


@pytest.mark.parametrize("query_aware", [True, False])
def test_press_methods_through_the_runner(tmp_path, engine, query_aware):
    pytest.importorskip("kvforge.presses")
    trials = press_trials(["full", *PRESS_METHODS], [0.5], query_aware=query_aware)
    assert [t.key for t in trials] == [("full", 0.0)] + [(m, 0.5) for m in PRESS_METHODS]
    rows = EvalRunner(engine, trials, tmp_path, {"model": "tiny"}, with_fidelity=True, max_new_tokens=2).run(
        _examples()[:1], progress=False
    )
    by = {r["method"]: r for r in rows}
    assert by["full"]["kept_ratio"] == 1.0
    prompt = by["full"]["prompt_tokens"]
    ctx, _ = engine.encode_qa(_examples()[0].context, _examples()[0].question, answer_prefix="The code is")
    compressed = prompt if query_aware else len(ctx)
    snap = by["snapkv"]["kept_ratio"]
    assert snap == pytest.approx((compressed // 2 + prompt - compressed) / prompt)
    assert by["full"]["ttft_stages"] == {"prefill": pytest.approx(by["full"]["ttft_s"], abs=1e-6), "compression": 0.0,
                                         "lookahead": 0.0}  # fmt: skip
    for method in PRESS_METHODS:
        assert 0.3 < by[method]["kept_ratio"] < 0.75, method
        assert by[method]["cache_bytes"] <= by["full"]["cache_bytes"]
        stages = by[method]["ttft_stages"]  # the press's own clocks, adding up to the TTFT
        assert stages["compression"] > 0 and stages["lookahead"] == 0.0, method
        assert sum(stages.values()) == pytest.approx(by[method]["ttft_s"], abs=1e-5), method
        assert by[method]["kl"] >= 0 and 0 <= by[method]["needle_kept"] <= 1


def test_press_options_are_methods_of_their_own(tmp_path, engine):
    """``snapkv:window_size=8`` is its own row beside ``snapkv``, built with the option; the CLI names a bad option
    before any model loads."""
    pytest.importorskip("kvforge.presses")
    trials = press_trials(["full", "snapkv", "snapkv:window_size=8"], [0.5])
    assert [t.key for t in trials] == [("full", 0.0), ("snapkv", 0.5), ("snapkv:window_size=8", 0.5)]
    assert trials[2].press.window_size == 8 and trials[1].press.window_size == 64
    runner = EvalRunner(engine, trials, tmp_path, {"model": "tiny"}, max_new_tokens=2)
    rows = runner.run(_examples()[:1], progress=False)
    assert sorted(r["method"] for r in rows) == ["full", "snapkv", "snapkv:window_size=8"]


def test_a_bad_press_option_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from kvforge.cli import main
    from kvforge.commands import eval as eval_command

    monkeypatch.setattr(eval_command, "load_engine", lambda args: pytest.fail("the model was loaded"))
    argv = ["eval", "--model", "smollm2-135m", "--task", "needle", "--out", str(tmp_path / "o"), "--methods"]
    assert main([*argv, "full,kvzip:pool=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvforge: error: press 'kvzip:pool=4': pool must be 0 (off) or an odd window, got 4"
    assert main([*argv, "kvzip:value_aware=maybe", "--store-once", "--quants", "kvtc"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvforge: error: press 'kvzip:value_aware=maybe': option value_aware must be true or false " \
        "(default False), got 'maybe'"
    assert not (tmp_path / "o").exists()


def test_cli_main_reports_a_malformed_line(tmp_path, capsys):
    from kvforge.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "context": "c", "question": "q", "answers": ["a"]}\n{oops\n')
    assert main(["eval", "--model", "smollm2-135m", "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert (
        capsys.readouterr().err.strip() == f"kvforge: error: {bad}:2: invalid JSON (Expecting property name "
        "enclosed in double quotes at column 2)"
    )


@pytest.mark.parametrize("query_aware", [True, False])
def test_shared_prefill_gives_the_rows_of_separate_prefills(tmp_path, engine, query_aware):
    """One prefill per example for every press x ratio: same predictions, budgets and fidelity as separate ones."""
    methods = ["full", "snapkv", "pyramidkv", "criticaladakv", "surrogatekv-global", "streaming_llm", "h2o"]
    trials = press_trials(methods, [0.5, 0.75], query_aware=query_aware)
    rows = {}
    for share in (True, False):
        out = tmp_path / str(share)
        runner = EvalRunner(engine, trials, out, {"model": "tiny"}, with_fidelity=True, max_new_tokens=3,
                            share_prefill=share)  # fmt: skip
        rows[share] = {(r["id"], r["method"], r["compression_ratio"]): r for r in runner.run(_examples(), False)}
    assert rows[True].keys() == rows[False].keys() and len(rows[True]) == 2 * (1 + 2 * (len(methods) - 1))
    for key, a in rows[True].items():
        b = rows[False][key]
        for col in ("prediction", "num_entries", "kept_ratio", "cache_bytes", "prompt_tokens", "needle_kept"):
            assert a.get(col) == b.get(col), (key, col)
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-4)
        assert a["answer_nll"] == pytest.approx(b["answer_nll"], abs=1e-4)
        assert a["ttft_s"] > 0


def test_shared_prefill_resumes_after_the_full_row(tmp_path, engine):
    """A re-run that finds only the full rows rebuilds the reference first, then compresses (no stale cache)."""
    trials = press_trials(["full", "snapkv", "adakv"], [0.5])
    ref_runner = EvalRunner(engine, trials, tmp_path / "ref", {"model": "tiny"}, with_fidelity=True, max_new_tokens=3)
    ref = {(r["id"], r["method"]): r for r in ref_runner.run(_examples(), False)}
    out = tmp_path / "resumed"
    EvalRunner(engine, trials[:1], out, {"model": "tiny"}, with_fidelity=True, max_new_tokens=3).run(_examples(), False)
    rows = EvalRunner(engine, trials, out, {"model": "tiny"}, with_fidelity=True, max_new_tokens=3).run(
        _examples(), False
    )
    assert len(rows) == len(ref)
    for r in rows:
        want = ref[(r["id"], r["method"])]
        assert (r["prediction"], r["num_entries"], r["kept_ratio"]) == (
            want["prediction"], want["num_entries"], want["kept_ratio"])
        assert r["kl"] == pytest.approx(want["kl"], abs=1e-4)


def test_a_learned_press_is_trained_before_the_shared_prefill_binds_it(tmp_path, monkeypatch, engine):
    """On a machine that never trained KVzap for the model, an evaluation of kvzap beside another press trains the
    scorer first (once, in the cache dir), instead of failing when the example's shared prefill binds it."""
    from kvforge.kvzap_train import model_path
    from kvforge.presses.kvzip_heads import fingerprint_of

    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "cache"))
    path = model_path(fingerprint_of(engine.model, engine.tokenizer), "linear")
    assert not path.exists()
    trials = press_trials(["full", "kvzap:budget=head", "snapkv"], [0.5], query_aware=False)
    rows = EvalRunner(engine, trials, tmp_path / "out", {"model": "tiny"}, max_new_tokens=2).run(
        _examples()[:1], progress=False
    )
    assert path.exists() and {r["method"] for r in rows} == {"full", "kvzap:budget=head", "snapkv"}
