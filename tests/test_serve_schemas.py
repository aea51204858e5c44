"""Request validation, error bodies and the scheduler's queue, through FastAPI's TestClient (no network)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from kvforge.engine import Engine
from kvforge.errors import Aborted, UserError
from kvforge.request import Request
from kvforge.serve import create_app
from kvforge.serve.errors import APIError
from kvforge.serve.jobs import QueueFullError
from kvforge.serve.metrics import store_tiers
from kvforge.serve.scheduler import Scheduler
from kvforge.serve.stream import DeltaStream
from kvforge.serve.translate import split_context_question
from kvforge.testing import tiny_model, tiny_tokenizer

MODEL = "tiny"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model("llama"), tiny_tokenizer())


@pytest.fixture(scope="module")
def client(engine: Engine) -> Any:
    with TestClient(create_app(engine, model_name=MODEL, max_body_bytes=4096)) as c:
        yield c


def _err(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


def test_chat_accepts_text_parts_and_developer_role(client: Any, engine: Engine) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0, "user": "ignored-field"},
    )
    assert r.status_code == 200, r.text
    expected = engine.generate([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], 5)
    assert r.json()["choices"][0]["message"]["content"] == expected.text


def test_completion_token_prompt_and_echo(client: Any, engine: Engine) -> None:
    ids = engine.encode_chat("abc", raw=True)
    by_ids = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0})
    by_text = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": ["abc"], "max_tokens": 4, "temperature": 0, "echo": True}
    )
    assert by_ids.status_code == by_text.status_code == 200
    assert by_text.json()["choices"][0]["text"] == "abc" + by_ids.json()["choices"][0]["text"]
    assert by_ids.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.role"),
        ({"model": MODEL, "messages": CHAT, "n": 2}, "n"),
        ({"model": MODEL, "messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": MODEL, "messages": CHAT, "stop": [""]}, "stop"),
        ({"model": MODEL, "messages": CHAT, "top_p": 0}, "top_p"),
        ({"model": MODEL, "messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": CHAT, "stream": "yes"}, "stream"),
        ({"model": 5, "messages": CHAT}, "model"),
        ({"model": MODEL, "messages": CHAT, "kvforge": {"press": "snapkv", "ratio": 0.5}}, "kvforge.ratio"),
        ({"model": MODEL, "messages": CHAT, "kvforge": {"compression_ratio": -0.1}}, "kvforge.compression_ratio"),
        ({"model": MODEL, "messages": CHAT, "kvforge": {"reuse": "exact"}}, "kvforge.reuse"),
        ({"model": MODEL, "messages": CHAT, "kvforge": {"semantic_mode": "fuzzy"}}, "kvforge.semantic_mode"),
        ({"model": MODEL, "messages": CHAT, "kvforge": {"query_aware": "no"}}, "kvforge.query_aware"),
        ({"model": MODEL, "messages": CHAT, "kvforge": "snapkv"}, "kvforge"),
    ],
)
def test_invalid_chat_bodies_are_400(client: Any, body: dict[str, Any], param: str) -> None:
    error = _err(client.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize("prompt", [["a", "b"], "", [], 42])
def test_invalid_prompts_are_400(client: Any, prompt: Any) -> None:
    assert _err(client.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400)["param"] == "prompt"


def test_semantic_mode_needs_semantic_reuse(client: Any) -> None:
    body = {"model": MODEL, "messages": CHAT, "kvforge": {"semantic_mode": "context"}}
    assert _err(client.post("/v1/chat/completions", json=body), 400)["param"] == "kvforge.semantic_mode"


def test_max_tokens_past_the_context(client: Any, engine: Engine) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": engine.max_positions}
    assert _err(client.post("/v1/completions", json=body), 400)["code"] == "context_length_exceeded"


def test_routes_and_methods_answer_in_openai_shape(client: Any) -> None:
    assert client.get("/v1/models/tiny").json()["id"] == MODEL
    assert _err(client.get("/v1/models/other"), 404)["code"] == "model_not_found"
    assert _err(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    _err(client.get("/v1/chat/completions"), 405)


def test_body_limit_applies_to_chunked_bodies(client: Any) -> None:
    def chunks() -> Any:
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    r = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert _err(r, 413)["code"] == "request_too_large"


def test_documents_validation(client: Any) -> None:
    assert _err(client.post("/v1/kv/documents", json={"documents": []}), 400)["param"] == "documents"
    assert _err(client.post("/v1/kv/documents", json={"documents": ["  "]}), 400)["param"] == "documents"
    assert _err(client.post("/v1/kv/documents", json={"documents": ["a"], "mode": "x"}), 400)["param"] == "mode"
    assert _err(client.post("/v1/kv/documents", json={"documents": ["a"], "model": "x"}), 404)["param"] == "model"


@pytest.mark.parametrize("scheduler", ["batched", "serial"])
def test_engine_failure_is_500_and_the_server_keeps_serving(engine: Engine, scheduler: str) -> None:
    fail = {"now": True}

    def boom(module: Any, args: Any) -> None:  # the model's forward fails (the batch's packed step or a prefill)
        if fail["now"]:
            raise RuntimeError("boom")

    broken = Engine(engine.model, engine.tokenizer)
    hook = engine.model.register_forward_pre_hook(boom)
    try:
        with TestClient(create_app(broken, model_name=MODEL, scheduler=scheduler), raise_server_exceptions=False) as c:
            body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
            assert _err(c.post("/v1/chat/completions", json=body), 500)["type"] == "server_error"
            fail["now"] = False
            assert c.post("/v1/chat/completions", json=body).status_code == 200
    finally:
        hook.remove()


def test_create_app_rejects_bad_defaults(engine: Engine) -> None:
    with pytest.raises(UserError):
        create_app(engine, compression_ratio=1.0)
    with pytest.raises(UserError):
        create_app(engine, press="no-such-press")


# ------------------------------------------------------------------------------------------------ pieces
def testsplit_context_question() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "doc\n\npart\n\nWhat?"}]
    assert split_context_question(msgs) == ("doc\n\npart", "What?", "S")
    for bad in (
        [{"role": "user", "content": "no separator"}],
        "raw text",
        [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c"}],
    ):
        with pytest.raises(APIError):
            split_context_question(bad)


def test_delta_stream_holds_back_stop_strings() -> None:
    tok = tiny_tokenizer()
    ids = tok("hello STOP world", add_special_tokens=False).input_ids
    sent: list[str] = []
    stream = DeltaStream(tok, ["STOP", "zz"], sent.append)
    for t in ids:
        stream(t)
    stream.finish("hello ")  # what the engine returns: trimmed at the stop string
    assert "".join(sent) == "hello " and all("S" not in d for d in sent)
    plain: list[str] = []
    stream = DeltaStream(tok, [], plain.append)
    for t in ids:
        stream(t)
    stream.finish("hello STOP world")
    assert plain == list("hello STOP world")


def test_store_tiers_labels() -> None:
    assert store_tiers(None) == []
    assert store_tiers({"backend": "file", "bytes": 5}) == [("0:file", {"backend": "file", "bytes": 5})]
    tiered = {"backend": "tiered", "tiers": [{"backend": "memory", "bytes": 1}, {"backend": "file", "bytes": 2}]}
    assert [label for label, _ in store_tiers(tiered)] == ["0:memory", "1:file"]


def test_queue_bound_and_cancelled_jobs_never_run(engine: Engine) -> None:
    loop = asyncio.new_event_loop()
    scheduler = Scheduler(engine, max_queue=1, max_running=1)
    gate, ran = threading.Event(), []
    try:
        first = scheduler.submit(lambda job: gate.wait(5), loop, None)
        while not scheduler.busy:
            time.sleep(0.005)
        second = scheduler.submit(lambda job: ran.append("second"), loop, None)
        with pytest.raises(QueueFullError):
            scheduler.submit(lambda job: ran.append("third"), loop, None)
        second.cancel()
        gate.set()
        loop.run_until_complete(asyncio.wait({first.future, second.future}, timeout=5))
        third = scheduler.submit(lambda job: ran.append("third"), loop, None)
        for job in (first, second, third):
            loop.run_until_complete(asyncio.wait({job.future}, timeout=5))
        assert ran == ["third"]
        assert isinstance(second.future.exception(), Aborted)
        assert first.future.result() is True
    finally:
        scheduler.close()
        loop.close()


def test_scheduler_refuses_requests_that_would_time_out(engine: Engine) -> None:
    loop = asyncio.new_event_loop()
    scheduler = Scheduler(engine, max_queue=8, max_running=1)
    try:
        assert scheduler.expected_wait_s() == 0.0  # nothing measured yet
        scheduler.num_done, scheduler.finish_rate, scheduler.avg_job_s = 4, 0.5, 2.0  # as if each took 2 s
        gate = threading.Event()
        first = scheduler.submit(lambda job: gate.wait(5), loop, 4.0)  # its own 3 s (1.5 x 2 s) fit in 4 s
        while not scheduler.busy:
            time.sleep(0.005)
        with pytest.raises(QueueFullError) as e:
            scheduler.submit(lambda job: None, loop, 4.0)  # 2 s ahead + its own 3 s do not
        assert e.value.retry_after_s >= 1
        scheduler.finish_rate, scheduler.avg_job_s = 1000.0, 0.1  # admitted on a low estimate...
        late = scheduler.submit_request(Request("hi", max_new_tokens=2), loop, 0.5)
        scheduler.avg_job_s = 2.0  # ...but by the time it could start, 0.5 s no longer covers a job: refused, not run
        gate.set()
        loop.run_until_complete(asyncio.wait({first.future, late.future}, timeout=5))
        assert isinstance(late.future.exception(), QueueFullError) and not engine.running
    finally:
        scheduler.close()
        loop.close()


def test_shutdown_stops_the_worker(engine: Engine) -> None:
    app = create_app(engine, model_name=MODEL)
    with TestClient(app) as c:
        assert c.get("/health").json()["busy"] is False
    app.state.worker._thread.join(5)
    assert not app.state.worker._thread.is_alive()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "seed": 2**64}, "seed"),
        ({"prompt": "hi", "seed": -1}, "seed"),
        ({"prompt": "hi", "seed": 1.5}, "seed"),
        ({"prompt": [5, -1, 7]}, "prompt"),
        ({"prompt": [5, 10**6]}, "prompt"),
        ({"prompt": [5, 2**70]}, "prompt"),
        ({"prompt": [[5, -3]]}, "prompt"),
        ({"prompt": [True, False]}, "prompt"),
        ({"prompt": {"text": "hi"}}, "prompt"),
        ({"prompt": "hi", "temperature": "nan"}, "temperature"),
        ({"prompt": "hi", "temperature": float("inf")}, "temperature"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "top_p": float("nan")}, "top_p"),
        ({"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "hi", "stop": 5}, "stop"),
        ({"prompt": "hi", "kvforge": {"compression_ratio": float("nan")}}, "kvforge.compression_ratio"),
    ],
)
def test_odd_inputs_are_400_naming_the_field(client: Any, body: dict[str, Any], param: str) -> None:
    """Odd values are an OpenAI-style 400 that names the field, never a traceback or a 500."""
    content = json.dumps({"model": MODEL, "max_tokens": 2} | body)  # NaN/inf as the bare JSON words clients send
    r = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    error = _err(r, 400)
    assert error["param"] == param and "Traceback" not in error["message"]


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        [{"content": "hi"}],
        [{"role": "tool", "content": "hi"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ],
)
def test_odd_messages_are_400(client: Any, messages: Any) -> None:
    error = _err(client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}), 400)
    assert error["param"].startswith("messages")
