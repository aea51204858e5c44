"""Engine + reuse: plan -> prefill the rest -> decode -> record; the CLI flags; the reuse TTFT benchmark runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_reuse_prefix import SRC, DictStore, common_prefix

from kvforge.engine import Engine
from kvforge.reuse import FakeEmbedder, PrefixReuse, SemanticReuse
from kvforge.testing import tiny_model, tiny_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model("llama"), tiny_tokenizer(), chunk_size=32)


def test_generate_reuses_prefix_and_gives_the_same_answer(engine):
    baseline = engine.generate(PROMPT, max_new_tokens=4)
    store = DictStore()
    engine.reuse = PrefixReuse(store, engine.model_id, block_size=16)
    try:
        first = engine.generate(PROMPT, max_new_tokens=4)
        second = engine.generate(PROMPT, max_new_tokens=4)
        longer = engine.generate(PROMPT + "And then?", max_new_tokens=4)
    finally:
        engine.reuse = None
    assert first.reused_tokens == 0 and first.reuse.kind == "miss"
    n = first.prompt_tokens
    assert second.reused_tokens == n - 1 and second.reuse.kind == "prefix"
    assert first.token_ids == second.token_ids == baseline.token_ids
    a, b = engine.encode_chat(PROMPT), engine.encode_chat(PROMPT + "And then?")
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)  # template end differs
    assert longer.reused_tokens == common  # to the last shared token, not a block end
    assert second.ttft_s > 0 and second.reuse.plan_s is not None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_second_question_on_a_stored_document_prefills_only_the_question(arch):
    """Prompts through the chat template: the reused prefix ends where the two prompts diverge, which is the end of
    the document part (``encode_qa``'s context), and the answer is the one computed without reuse."""
    engine = Engine(tiny_model(arch), tiny_tokenizer(), chunk_size=64)
    doc = "".join(f"Fact {i}: room {i} holds {chr(97 + i % 26) * 3}. " for i in range(14))  # ~350 tokens
    questions = ["Which room holds ddd?", "What does room 7 hold?", "List every room."]
    plain = [engine.answer(doc, q, max_new_tokens=4) for q in questions]
    store = DictStore()
    engine.reuse = PrefixReuse(store, engine.model_id, block_size=64)
    try:
        answers = [engine.answer(doc, q, max_new_tokens=4) for q in questions]
    finally:
        engine.reuse = None
    for q, answer, expected in zip(questions, answers, plain, strict=True):
        assert answer.token_ids == expected.token_ids
        ctx_ids, q_ids = engine.encode_qa(doc, q)
        assert answer.prompt_tokens == len(ctx_ids) + len(q_ids)
    prompts = [[*ctx, *q_ids] for ctx, q_ids in (engine.encode_qa(doc, q) for q in questions)]
    shared = [max((common_prefix(p, q) for q in prompts[:i]), default=0) for i, p in enumerate(prompts)]
    assert [a.reused_tokens for a in answers] == shared  # to the last token shared with a stored prompt
    ctx_ids, q_ids = engine.encode_qa(doc, questions[2])  # "List..." shares no question token with the others
    assert answers[2].reused_tokens == len(ctx_ids)
    assert answers[2].prompt_tokens - answers[2].reused_tokens == len(q_ids)
    assert shared[1] == len(ctx_ids) + 2  # "What..." after "Which...": "Wh" is reused too


def test_answer_context_mode_prefills_the_question(engine):
    doc = "Rouen is the capital of Normandy. It lies on the Seine. " * 3
    engine.reuse = SemanticReuse(DictStore(), engine.model_id, FakeEmbedder(), mode="context", threshold=0.8)
    try:
        base = engine.answer(doc, "Where is Rouen?", max_new_tokens=6)
        other = engine.answer(doc, "What river?", max_new_tokens=6)
    finally:
        engine.reuse = None
    plain = engine.answer(doc, "What river?", max_new_tokens=6)
    assert base.reused_tokens == 0 and other.reuse.kind == "prefix" and other.reused_tokens > 50
    assert other.token_ids == plain.token_ids


def test_reuse_rejects_sliding_window_engine():
    from kvforge.errors import UserError

    engine = Engine(tiny_model("llama"), tiny_tokenizer(), window=16, reuse=PrefixReuse(DictStore(), "x"))
    with pytest.raises(UserError, match="sliding-window"):
        engine.generate(PROMPT, max_new_tokens=2)


def test_cli_generate_reuse_across_processes(tiny_llama_dir, tmp_path, capsys):
    pytest.importorskip("kvforge.store")
    from kvforge.cli import main

    store = f"file://{tmp_path}/kv"
    argv = [
        "generate",
        "--model",
        str(tiny_llama_dir),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "4",
        "--store",
        store,
        "--reuse",
        "prefix",
    ]
    assert main(argv) == 0
    assert "reuse miss: 0/" in capsys.readouterr().err
    assert main(argv) == 0  # a new Engine and a reopened store: as a second process would
    err = capsys.readouterr().err
    assert "reuse prefix hit" in err and "TTFT" in err
    assert main([*argv[:-1], "semantic", "--threshold", "3"]) == 2
    assert "threshold" in capsys.readouterr().err
    assert main([*argv, "--press", "snapkv"]) == 2
    assert "query-agnostic on a document" in capsys.readouterr().err  # the engine's and the server's message


def test_reuse_ttft_benchmark_runs_through_the_engine(tiny_llama_dir, tmp_path):
    """benchmarks/reuse_ttft.py on a tiny model: a warm run reuses all but the last token, with the cold logits."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "reuse_ttft.py"
    out = tmp_path / "rows.jsonl"
    argv = [
        sys.executable,
        str(script),
        "--model",
        str(tiny_llama_dir),
        "--lengths",
        "40,80",
        "--repeats",
        "1",
        "--block-size",
        "16",
        "--store",
        "memory://",
        "--store",
        f"file://{tmp_path}/kv",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": SRC}
    subprocess.run(argv, check=True, env=env, capture_output=True, timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_tokens"], r["store"].split(":")[0]) for r in rows] == [
        (40, "memory"),
        (40, "file"),
        (80, "memory"),
        (80, "file"),
    ]
    for r in rows:
        assert r["reused_tokens"] == r["prompt_tokens"] - 1 and r["max_abs_logit_diff"] < 1e-4
        assert r["cold_ttft_s"] > 0 and r["warm_ttft_s"] > 0 and r["ttft_reduction"] < 1


def test_stored_kv_of_another_shape_is_a_miss_not_a_wrong_answer(engine, caplog):
    """A segment carrying this model's id but KV of another shape (someone wrote the store): checked against the
    model's config before use, and the answer is the full prefill's."""
    import torch

    baseline = engine.generate(PROMPT, max_new_tokens=4)
    store = DictStore()
    engine.reuse = PrefixReuse(store, engine.model_id, block_size=16)
    try:
        engine.generate(PROMPT, max_new_tokens=4)
        for key in list(store.data):  # forge: same keys and ids, KV cast to another dtype
            seg = store.data[key]
            seg.keys = [k.to(torch.float16) for k in seg.keys]
            seg.values = [v.to(torch.float16) for v in seg.values]
        with caplog.at_level("WARNING"):
            forged = engine.generate(PROMPT, max_new_tokens=4)
    finally:
        engine.reuse = None
    assert forged.reused_tokens == 0 and forged.token_ids == baseline.token_ids
    assert any("does not fit this model" in r.getMessage() for r in caplog.records)
