"""The server's prefix reuse to the last matching token: a second question on a stored ~3k-token document reports
the document's tokens as cached (``usage.prompt_tokens_details.cached_tokens``) and answers as without reuse.

The questions start with different tokens, so the prompts diverge exactly where the document part ends (questions
sharing their first words would also reuse those: reuse goes to the last matching token)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from kvforge.engine import Engine
from kvforge.serve import create_app
from kvforge.testing import tiny_model, tiny_tokenizer

DOC = "".join(f"Fact {i}: the code word of room {i} is {chr(97 + i % 26) * 3}. " for i in range(75))
QUESTIONS = ["Which room has the code word ddd?", "Room 7: what is its code word?", "Name room 12's code word."]


def chat(client: TestClient, question: str) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": DOC + "\n\n" + question}],
        "max_tokens": 4,
        "temperature": 0,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    """Each question's greedy answer without any reuse."""
    engine = Engine(tiny_model("llama", max_position_embeddings=4096), tiny_tokenizer())
    return {q: engine.answer(DOC, q, max_new_tokens=4).text for q in QUESTIONS}


@pytest.mark.parametrize("stored_by", ["documents endpoint", "first question"])
def test_second_question_on_a_stored_document_prefills_only_the_question(stored_by, expected, tmp_path):
    engine = Engine(tiny_model("llama", max_position_embeddings=4096), tiny_tokenizer())
    doc_tokens = len(engine.encode_qa(DOC, QUESTIONS[0])[0])
    assert doc_tokens > 3000
    app = create_app(engine, model_name="tiny", store_url=f"file://{tmp_path}/kv", reuse="prefix")
    with TestClient(app) as client:
        if stored_by == "documents endpoint":
            r = client.post("/v1/kv/documents", json={"documents": [DOC]})
            assert r.status_code == 200, r.text
            assert r.json()["data"][0]["tokens"] == doc_tokens
            asked = QUESTIONS
        else:
            first = chat(client, QUESTIONS[0])
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert first["choices"][0]["message"]["content"] == expected[QUESTIONS[0]]
            asked = QUESTIONS[1:]
        for question in asked:
            out = chat(client, question)
            assert len(engine.encode_qa(DOC, question)[0]) == doc_tokens
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == doc_tokens
            assert out["usage"]["prompt_tokens"] == doc_tokens + len(engine.encode_qa(DOC, question)[1])
            assert out["choices"][0]["message"]["content"] == expected[question]
