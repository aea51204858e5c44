"""``kvforge route`` with compressed documents, in front of a fake vLLM: ``POST /v1/kv/documents`` compresses and
stores (kvforge's engine on a tiny model); a chat whose user message starts with a stored document becomes a
completion on the document's placeholder slots (``kv_transfer_params`` naming it) and its answer a chat answer,
streamed or not; a document not stored, or stored under another press, is a full prefill; a document the connector
could not load is asked again in full. No vLLM, no network."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from kvforge.engine import Engine
from kvforge.reuse import FakeEmbedder
from kvforge.route import build_normalizer, create_router_app
from kvforge.route.documents import DocumentRouter
from kvforge.store import open_store
from kvforge.testing import tiny_model, tiny_tokenizer
from kvforge.vllm import documents as docs
from kvforge.vllm.client import VllmDocuments
from kvforge.vllm.identity import ServedModel, announce

MODEL = "/models/tiny"
DOC = "The lighthouse keeper painted the code 4817 above the door. " * 5
QUESTION = "What code was painted?"


class FakeVLLM:
    """Answers completions and chats like vLLM with kvforge's connector; reports a named document loaded unless
    ``loads`` is False."""

    def __init__(self, loads: bool = True) -> None:
        self.loads = loads
        self.received: list[tuple[str, dict]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        self.received.append((request.url.path, body))
        if request.url.path == "/v1/completions":
            params = body.get("kv_transfer_params")
            doc = docs.ServedDocument.from_params(params)
            report = {docs.PARAM: {"key": doc.key, "loaded": self.loads, "slots": doc.num_slots}} if doc else None
            if body.get("stream"):
                events = [{"id": "cmpl-1", "choices": [{"index": 0, "text": w, "finish_reason": None}]}
                          for w in ("It ", "is ", "4817.")]  # fmt: skip
                lines = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                return httpx.Response(200, content=lines.encode(), headers={"content-type": "text/event-stream"})
            return httpx.Response(200, json={"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                                             "choices": [{"index": 0, "text": "It is 4817.", "finish_reason": "stop"}],
                                             "usage": {"prompt_tokens": len(body["prompt"])},
                                             "kv_transfer_params": report})  # fmt: skip
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "full"}}]})
        return httpx.Response(200, json={})


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model("llama"), tiny_tokenizer())


def _router(engine, upstream: FakeVLLM, press: str | None = "knorm"):
    store = open_store("memory://")
    announce(store, ServedModel(MODEL, engine.model_id, 16))
    base = VllmDocuments(store, engine.tokenizer, engine.model_id, None, engine=engine)
    documents = DocumentRouter(base, press=press, compression_ratio=0.75, max_model_len=2048)
    normalizer = build_normalizer(store, MODEL, embedder=FakeEmbedder())
    app = create_router_app(normalizer, "http://vllm.test", transport=httpx.MockTransport(upstream.handler),
                            documents=documents)  # fmt: skip
    return TestClient(app), documents


def _chat(question: str = QUESTION, doc: str = DOC, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"{doc}\n\n{question}"}], **extra}


def test_a_stored_document_is_served_from_its_slots(engine):
    upstream = FakeVLLM()
    client, documents = _router(engine, upstream)
    with client:
        stored = client.post("/v1/kv/documents", json={"documents": [DOC]})
        assert stored.status_code == 200, stored.text
        entry = stored.json()["data"][0]
        assert entry["kv_slots"] == int(entry["tokens"] * 0.25) and entry["press"] == "knorm"
        answer = client.post("/v1/chat/completions", json=_chat(max_tokens=8))
    assert answer.status_code == 200 and answer.headers["x-kvforge-document"].startswith("hit")
    body = answer.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "It is 4817."
    assert body["kvforge"]["document"] == "hit" and body["kvforge"]["kv_slots"] == entry["kv_slots"]
    path, sent = upstream.received[-1]
    doc = docs.ServedDocument.from_params(sent["kv_transfer_params"])
    _, q_ids = documents.client("knorm", 0.75, None).key(DOC, QUESTION)
    assert path == "/v1/completions" and sent["prompt"] == doc.placeholder_ids() + q_ids and sent["max_tokens"] == 8


def test_a_streamed_answer_is_a_chat_stream(engine):
    upstream = FakeVLLM()
    client, _ = _router(engine, upstream)
    with client:
        client.post("/v1/kv/documents", json={"documents": [DOC]})
        with client.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as answer:
            lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "It "}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "It is 4817."
    assert upstream.received[-1][1]["max_tokens"] > 0  # a chat without max_tokens may fill the context


def test_documents_not_stored_or_under_another_press_are_full_prefills(engine):
    upstream = FakeVLLM()
    client, _ = _router(engine, upstream)
    with client:
        client.post("/v1/kv/documents", json={"documents": [DOC]})
        other_doc = client.post("/v1/chat/completions", json=_chat(doc=DOC + " And more."))
        other_press = client.post("/v1/chat/completions", json=_chat(kvforge={"press": "streaming_llm"}))
        tools = client.post("/v1/chat/completions", json=_chat(tools=[]))
    assert other_doc.json()["kvforge"]["document"] == "miss" and other_press.json()["kvforge"]["document"] == "miss"
    assert "tools" in tools.json()["kvforge"]["document_reason"]
    asked = [(path, body) for path, body in upstream.received if path.startswith("/v1/")]
    assert [path for path, _ in asked] == ["/v1/chat/completions"] * 3
    assert all("kv_transfer_params" not in body and "kvforge" not in body for _, body in asked)


def test_a_document_the_connector_could_not_load_is_asked_again_in_full(engine):
    upstream = FakeVLLM(loads=False)
    client, _ = _router(engine, upstream)
    with client:
        client.post("/v1/kv/documents", json={"documents": [DOC]})
        answer = client.post("/v1/chat/completions", json=_chat())
    assert (
        answer.json()["kvforge"]["document"] == "fallback"
        and answer.json()["choices"][0]["message"]["content"] == "full"
    )
    assert [path for path, _ in upstream.received[-2:]] == ["/v1/completions", "/v1/chat/completions"]


def test_bad_documents_requests_are_400s(engine):
    client, _ = _router(engine, FakeVLLM(), press=None)
    with client:
        no_press = client.post("/v1/kv/documents", json={"documents": [DOC]})
        ragged = client.post("/v1/kv/documents", json={"documents": [DOC], "press": "adakv"})
        bad = client.post("/v1/kv/documents", json={"documents": []})
        plain = client.post("/v1/chat/completions", json=_chat())  # no press anywhere: not matched
    assert no_press.status_code == 400 and "needs a press" in no_press.json()["error"]["message"]
    assert ragged.status_code == 400 and "different number of entries" in ragged.json()["error"]["message"]
    assert bad.status_code == 400
    assert plain.json()["kvforge"]["document"] == "skip"
