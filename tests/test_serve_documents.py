"""Compressed documents through the server: stored by POST /v1/kv/documents, reused by chat requests (openai client)."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import LONG_DOC, MODEL, LiveServer  # noqa: E402

from kvforge.engine import Engine  # noqa: E402
from kvforge.presses import build_press  # noqa: E402
from kvforge.serve import create_app  # noqa: E402
from kvforge.testing import tiny_model, tiny_tokenizer  # noqa: E402

QUESTION = "What is the code word of room 3?"


def _ask(client: Any, doc: str, **kvforge: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": doc + "\n\n" + QUESTION}],
        max_tokens=4,
        temperature=0,
        extra_body={"kvforge": {"query_aware": False, **kvforge}},
    )


def test_compressed_document_stored_then_reused(tmp_path: Any) -> None:
    live = LiveServer(
        create_app(
            Engine(tiny_model("llama"), tiny_tokenizer()),
            model_name=MODEL,
            store_url=f"file://{tmp_path}",
            reuse="prefix",
        )
    )
    try:
        client = live.client()
        for quant in ("none", "int4"):
            body = {"documents": [LONG_DOC], "press": "knorm", "compression_ratio": 0.5, "quant": quant}
            r = httpx.post(live.url + "/v1/kv/documents", json=body, timeout=30)
            assert r.status_code == 200, r.text
            (entry,) = r.json()["data"]
            assert entry["id"].startswith("doc-v1-") and entry["quant"] == quant and entry["stored_bytes"] > 0
            assert entry["kept_entries"] < 2 * 2 * entry["tokens"]  # 2 layers x 2 KV heads: half of them kept
            out = _ask(client, LONG_DOC, press="knorm", compression_ratio=0.5, quant=quant)
            kvf = out.model_extra["kvforge"]
            assert out.usage.prompt_tokens_details.cached_tokens == entry["tokens"] > 0
            assert kvf["reuse"] == "prefix" and kvf["compressed"] and kvf["bytes_loaded"] > 0 and kvf["quant"] == quant
        # full precision: the same answer as the compressed run in one process
        alone = Engine(tiny_model("llama"), tiny_tokenizer()).answer(
            LONG_DOC, QUESTION, press=build_press("knorm", compression_ratio=0.5), query_aware=False, max_new_tokens=4
        )
        assert _ask(client, LONG_DOC, press="knorm", compression_ratio=0.5).choices[0].message.content == alone.text
        # another ratio is a miss (then stored for the next request), never the document stored under 0.5
        other = _ask(client, LONG_DOC, press="knorm", compression_ratio=0.25, quant="none")
        assert other.usage.prompt_tokens_details.cached_tokens == 0 and not other.model_extra["kvforge"]["compressed"]
        # a press with reuse but query-aware: the engine's one error
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": LONG_DOC + "\n\n" + QUESTION}],
                max_tokens=2,
                extra_body={"kvforge": {"press": "knorm"}},
            )
        assert "query-agnostic on a document" in str(e.value)
        r = httpx.post(live.url + "/v1/kv/documents", json={"documents": ["x"], "quant": "int3", "press": "knorm"})
        assert r.status_code == 400 and "int3" in r.text
    finally:
        live.close()


def test_a_refused_documents_request_leaves_nothing_running() -> None:
    """A documents request answered 429 (the queue filled while its documents were queued) cancels those already
    queued or admitted: they leave the engine at its next step and none is computed or stored."""
    import threading

    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    gate = threading.Event()  # no step runs before the 429 is answered: nothing can finish before it
    real_step = engine.step

    def gated_step() -> Any:
        gate.wait(30)
        return real_step()

    engine.step = gated_step  # type: ignore[method-assign]
    app = create_app(engine, model_name=MODEL, store_url="memory://", reuse="prefix", max_queue=2, max_running=1)
    live = LiveServer(app)
    try:
        docs = [f"{LONG_DOC} Document {i}." for i in range(6)]
        r = httpx.post(live.url + "/v1/kv/documents", json={"documents": docs}, timeout=30)
        assert r.status_code == 429, r.text
        scheduler = app.state.server.scheduler
        gate.set()
        deadline = time.monotonic() + 20
        while scheduler.num_running or scheduler.depth:
            assert time.monotonic() < deadline, "the refused request's documents kept running"
            time.sleep(0.05)
        assert scheduler.num_done == 0 and app.state.server.engine.reuse.store.keys() == []
    finally:
        gate.set()
        live.close()
