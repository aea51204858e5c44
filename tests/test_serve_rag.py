"""RAG chunks stored through ``POST /v1/kv/documents`` (``mode: chunks``) and reused by chat requests that ask for
``kvforge.rag``, with the stock ``openai`` client against a live server (tiny model, character tokenizer)."""

from __future__ import annotations

from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from test_serve import MODEL, LiveServer  # noqa: E402

from kvforge.engine import Engine  # noqa: E402
from kvforge.reuse.rag import ChunkReuse  # noqa: E402
from kvforge.serve import create_app  # noqa: E402
from kvforge.testing import tiny_model, tiny_tokenizer  # noqa: E402

CHUNKS = ["The red door opens at noon.", "The blue door opens at dusk.", "The green door never opens."]
QUESTION = "Which door opens at noon?"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model("llama"), tiny_tokenizer())


@pytest.fixture(scope="module")
def live(engine: Engine) -> Any:
    server = LiveServer(create_app(engine, model_name=MODEL))
    yield server
    server.close()


@pytest.fixture(scope="module")
def stored(live: LiveServer) -> list[dict[str, Any]]:
    r = httpx.post(live.url + "/v1/kv/documents", json={"documents": CHUNKS, "mode": "chunks"}, timeout=30)
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def ask(live: LiveServer, **kvforge: Any) -> Any:
    return live.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=4,
        temperature=0,
        extra_body={"kvforge": kvforge},
    )


@pytest.mark.parametrize(
    ("method", "ratio"), [("naive", None), ("ape", None), ("cacheblend", 0.5), ("cacheclip", 0.5), ("epic", 0.5)]
)
def test_chat_reuses_the_stored_chunks(live: LiveServer, stored: list[dict[str, Any]], method: str, ratio: Any) -> None:
    ids = [d["id"] for d in stored]
    out = ask(live, rag=method, chunk_ids=ids, **({"recompute_ratio": ratio} if ratio is not None else {}))
    kvf = out.model_extra["kvforge"]
    assert kvf["reuse"] == "chunks" and kvf["rag"]["method"] == method
    assert kvf["rag"]["chunks"] == len(CHUNKS) and kvf["rag"]["chunk_misses"] == 0  # every chunk came from the store
    num_chunk_tokens = sum(d["tokens"] for d in stored)
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached == kvf["reused_tokens"] > 0
    recomputed = kvf["rag"]["recomputed_tokens"]
    if ratio is None:
        assert recomputed == 0 and cached >= num_chunk_tokens  # every chunk token reused (and the prefix, if any)
    else:
        assert recomputed >= round(ratio * num_chunk_tokens) and cached >= num_chunk_tokens - recomputed
    assert out.choices[0].message.content is not None


def test_chunks_by_text_hit_the_same_entries_and_answer_alike(live: LiveServer, stored: list[dict[str, Any]]) -> None:
    by_id = ask(live, rag="naive", chunk_ids=[d["id"] for d in stored])
    by_text = ask(live, rag="naive", chunks=CHUNKS)
    assert by_text.model_extra["kvforge"]["rag"]["chunk_misses"] == 0
    assert by_text.choices[0].message.content == by_id.choices[0].message.content
    assert by_text.usage.prompt_tokens == by_id.usage.prompt_tokens


def test_full_recompute_answers_like_a_plain_prefill(
    live: LiveServer, engine: Engine, stored: list[dict[str, Any]]
) -> None:
    out = ask(live, rag="cacheclip", recompute_ratio=1.0, chunk_ids=[d["id"] for d in stored])
    prompt = ChunkReuse(engine.model, engine.tokenizer).build_prompt(CHUNKS, QUESTION)
    plain = engine.generate(prompt.ids(), max_new_tokens=4)  # the server is idle: its worker does not use the engine
    assert out.choices[0].message.content == plain.text


def test_rag_requests_that_cannot_work_are_400(live: LiveServer, stored: list[dict[str, Any]]) -> None:
    ids = [d["id"] for d in stored]
    bad = [
        {"rag": "naive", "chunk_ids": ["0" * 64]},  # never stored
        {"rag": "naive", "chunk_ids": ids, "press": "snapkv"},  # not combined yet
        {"chunks": CHUNKS},  # chunks without a method
        {"rag": "naive"},  # a method without chunks
        {"rag": "naive", "chunks": CHUNKS, "chunk_ids": ids},
        {"rag": "ape", "chunks": CHUNKS, "recompute_ratio": 0.2},  # APE recomputes nothing
        {"rag": "blend", "chunks": CHUNKS},  # unknown method
    ]
    for kvforge in bad:
        with pytest.raises(openai.BadRequestError):
            ask(live, **kvforge)
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200
