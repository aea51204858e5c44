"""The server runs the engine's loop: questions on a stored compressed document and RAG requests are batched with
plain ones and answer as the Engine alone; big bodies are parsed and tokenised off the model thread."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import LONG_DOC, MODEL, LiveServer  # noqa: E402

from kvforge.engine import Engine  # noqa: E402
from kvforge.presses import build_press  # noqa: E402
from kvforge.request import Chunks, Document, Request  # noqa: E402
from kvforge.reuse.rag import ChunkReuse  # noqa: E402
from kvforge.serve import create_app  # noqa: E402
from kvforge.testing import tiny_model, tiny_tokenizer  # noqa: E402

QUESTIONS = [f"What is the code word of room {i}?" for i in range(8)]
CHUNKS = ["The cat sat on the mat all day.", "Paris is the capital of France.", "The code is 7731, remember it."]


def _engine() -> Engine:
    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    engine.eos_token_ids = []  # every answer runs to max_tokens: nothing ends early by chance
    return engine


def _concurrently(fns: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(fns)
    threads = [threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, f())) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_questions_on_a_stored_compressed_document_batched_answer_as_the_engine_alone() -> None:
    live = LiveServer(create_app(_engine(), model_name=MODEL, reuse="document", prefill_budget=16))
    press = {"press": "knorm", "compression_ratio": 0.5}
    try:
        r = httpx.post(live.url + "/v1/kv/documents", json={"documents": [LONG_DOC], **press}, timeout=60)
        assert r.status_code == 200, r.text
        client = live.client(timeout=120)

        def ask(question: str) -> Any:
            return client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"{LONG_DOC}\n\n{question}"}], max_tokens=6,
                temperature=0, extra_body={"kvforge": {**press, "query_aware": False}},
            )  # fmt: skip

        def plain() -> Any:
            return client.completions.create(model=MODEL, prompt="The sea is", max_tokens=6, temperature=0)

        out = _concurrently([lambda q=q: ask(q) for q in QUESTIONS] + [plain, plain])
        answers = [o.choices[0].message.content for o in out[: len(QUESTIONS)]]
        doc_tokens = r.json()["data"][0]["tokens"]
        assert all(o.usage.prompt_tokens_details.cached_tokens == doc_tokens for o in out[: len(QUESTIONS)])
        assert live.server.config.app.state.engine.stats["decode_rows"] > 0  # type: ignore[union-attr]
    finally:
        live.close()
    engine = _engine()  # the Engine alone, one question at a time, no store
    knorm = build_press("knorm", compression_ratio=0.5)
    alone = [engine.run(Request(Document(LONG_DOC, q), 6, press=knorm, query_aware=False)).text for q in QUESTIONS]
    assert answers == alone
    assert out[-1].choices[0].text == out[-2].choices[0].text == engine.run(Request("The sea is", 6, raw=True)).text


def test_rag_requests_batched_with_plain_ones_answer_as_alone() -> None:
    live = LiveServer(create_app(_engine(), model_name=MODEL, prefill_budget=16))
    try:
        client = live.client(timeout=120)

        def rag(method: str) -> Any:
            return client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "What is the code?"}], max_tokens=6, temperature=0,
                extra_body={"kvforge": {"rag": method, "chunks": CHUNKS}},
            )  # fmt: skip

        def plain() -> Any:
            return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)

        out = _concurrently([lambda: rag("naive"), lambda: rag("cacheblend"), plain, plain])
    finally:
        live.close()
    engine = _engine()
    alone = [
        engine.run(Request(Chunks(CHUNKS, "What is the code?"), 6, reuse=ChunkReuse(engine.model, engine.tokenizer,
                                                                                     method=m))).text
        for m in ("naive", "cacheblend")
    ]  # fmt: skip
    assert [o.choices[0].message.content for o in out[:2]] == alone
    assert out[2].choices[0].text == out[3].choices[0].text == engine.run(Request("Once upon a time", 6, raw=True)).text


class SlowDocumentsEngine(Engine):
    """Tokenising a document takes seconds (as a 7 MiB one does with a real tokenizer)."""

    def encode(self, request: Request) -> Any:
        if isinstance(request.prompt, Document):
            assert threading.current_thread().name != "kvforge-scheduler", "tokenised on the model thread"
            time.sleep(3.0)
        return super().encode(request)


def test_a_document_being_tokenised_does_not_stall_generations() -> None:
    engine = SlowDocumentsEngine(tiny_model("llama"), tiny_tokenizer())
    engine.eos_token_ids = []
    engine.model.register_forward_pre_hook(lambda module, args: time.sleep(0.04))  # the stream lasts > 5 s
    live = LiveServer(create_app(engine, model_name=MODEL, reuse="prefix"))
    try:
        stored: dict[str, Any] = {}

        def store() -> None:
            stored["start"] = time.monotonic()
            stored["r"] = httpx.post(live.url + "/v1/kv/documents", json={"documents": [LONG_DOC]}, timeout=60)
            stored["end"] = time.monotonic()

        sender = threading.Thread(target=store)
        token_times: list[float] = []
        stream = live.client().completions.create(model=MODEL, prompt="a", max_tokens=150, temperature=0, stream=True)
        for i, _ in enumerate(stream):
            token_times.append(time.monotonic())
            if i == 3:
                sender.start()  # the document arrives while the stream runs; it is tokenised for 3 s
        sender.join(60)
        assert stored["r"].status_code == 200, stored["r"].text
        during = [t for t in token_times if stored["start"] + 0.5 < t < stored["start"] + 3.0]
        assert len(during) >= 10  # tokens kept coming while the document was tokenised
    finally:
        live.close()


def test_huge_bodies_are_refused_before_the_model_thread() -> None:
    engine = _engine()
    added: list[Any] = []
    real_add = engine.add
    engine.add = lambda request, tag=None: added.append(request) or real_add(request, tag)  # type: ignore[method-assign]
    live = LiveServer(create_app(engine, model_name=MODEL))
    try:
        ids = [12345] * (1 << 20)  # 7 MiB of token ids as JSON
        r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        doc = "word " * (1 << 20)
        r = httpx.post(live.url + "/v1/kv/documents", json={"documents": [doc]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "documents[0]"
        assert added == []  # neither reached the engine
    finally:
        live.close()


def test_a_stream_starts_when_its_job_starts_not_at_the_next_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed request waits until the worker starts its job, then answers 200 and streams: the wait ends on the
    start itself while the job still runs (the poll interval only paces the disconnect checks), so a stream's first
    token is never held back to the next poll."""
    import asyncio

    from kvforge.serve import state
    from kvforge.serve.jobs import Job

    monkeypatch.setattr(state, "_POLL_S", 3600.0)

    class Connected:
        async def is_disconnected(self) -> bool:
            return False

    async def started_then_running() -> Any:
        loop = asyncio.get_running_loop()
        job = Job(lambda job: None, loop, None)  # its future stays pending: the job is still running
        loop.call_later(0.01, job.started_event.set)
        wait = state.Server.wait(object.__new__(state.Server), Connected(), job, until_started=True)  # type: ignore[arg-type]
        return await asyncio.wait_for(wait, 10.0)

    assert asyncio.run(started_then_running()) is True
