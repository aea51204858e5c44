"""A combination that does not work is the same error, word for word, from the engine, the CLI and the server."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from kvforge.cli import main
from kvforge.engine import Engine
from kvforge.errors import UserError
from kvforge.presses import DecodingPress, build_press
from kvforge.request import Document, Request
from kvforge.reuse import FakeEmbedder, PrefixReuse, SemanticReuse
from kvforge.serve import create_app
from kvforge.store import open_store
from kvforge.testing import tiny_model, tiny_tokenizer

DOC, QUESTION = "The code word of room 3 is apple. " * 3, "What is the code word of room 3?"

# name: (reuse, press, query_aware, engine options, CLI flags)
CASES: dict[str, tuple[str, bool, bool, dict[str, Any], list[str]]] = {
    "press query-aware with prefix reuse": ("prefix", True, True, {}, []),
    "press query-agnostic with semantic reuse": ("semantic", True, False, {}, ["--query-agnostic"]),
    "reuse with a sliding window": ("prefix", False, True, {"window": 64}, ["--window", "64"]),
    "reuse with a decoding budget": ("prefix", False, True, {"decoding_press": "budget"}, ["--decode-budget", "64"]),
}


def _engine(options: dict[str, Any]) -> Engine:
    if options.get("decoding_press"):
        options = options | {"decoding_press": DecodingPress(budget=64)}
    return Engine(tiny_model("llama"), tiny_tokenizer(), **options)


def _engine_error(reuse: str, press: bool, query_aware: bool, options: dict[str, Any]) -> str:
    engine = _engine(options)
    store = open_store("memory://")
    if reuse == "prefix":
        strategy: Any = PrefixReuse(store, engine.model_id)
    else:
        strategy = SemanticReuse(store, engine.model_id, FakeEmbedder())
    request = Request(Document(DOC, QUESTION), 2, reuse=strategy, query_aware=query_aware,
                      press=build_press("knorm", compression_ratio=0.5) if press else None)  # fmt: skip
    with pytest.raises(UserError) as e:
        engine.run(request)
    return str(e.value)


def _cli_error(reuse: str, press: bool, flags: list[str], model_dir: Any, tmp_path: Any, capsys: Any) -> str:
    (tmp_path / "doc.txt").write_text(DOC)
    argv = ["generate", "--model", str(model_dir), "--prompt-file", str(tmp_path / "doc.txt"), "--prompt", QUESTION,
            "--max-new-tokens", "2", "--reuse", reuse, *flags, *(["--press", "knorm"] if press else [])]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    return capsys.readouterr().err.strip().removeprefix("kvforge: error: ")


def _server_error(reuse: str, press: bool, query_aware: bool, options: dict[str, Any]) -> str:
    app = create_app(_engine(options), model_name="tiny", reuse=reuse, embedder=FakeEmbedder())
    kvforge: dict[str, Any] = {"query_aware": query_aware} | ({"press": "knorm"} if press else {})
    body = {"model": "tiny", "messages": [{"role": "user", "content": DOC + "\n\n" + QUESTION}], "max_tokens": 2,
            "kvforge": kvforge}  # fmt: skip
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    return str(r.json()["error"]["message"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_combination_one_error_everywhere(case: str, tiny_llama_dir: Any, tmp_path: Any, capsys: Any) -> None:
    reuse, press, query_aware, options, flags = CASES[case]
    engine = _engine_error(reuse, press, query_aware, options)
    assert _cli_error(reuse, press, flags, tiny_llama_dir, tmp_path, capsys) == engine
    assert _server_error(reuse, press, query_aware, options) == engine
