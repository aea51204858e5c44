"""The server against the stock ``openai`` client, live on 127.0.0.1 (uvicorn in a thread, tiny model)."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
import uvicorn  # noqa: E402

from kvforge.engine import Engine  # noqa: E402
from kvforge.serve import create_app  # noqa: E402
from kvforge.testing import tiny_model, tiny_tokenizer  # noqa: E402

MODEL = "tiny"
LONG_DOC = "".join(f"Fact {i}: the code word of room {i} is {chr(97 + i % 26) * 3}. " for i in range(24))  # ~900 chars


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


needs_presses = pytest.mark.skipif(not _have("kvforge.presses"), reason="kvforge.presses not importable")
_MISSING_REUSE = [m for m in ("kvforge.reuse", "kvforge.store") if not _have(m)]
needs_reuse = pytest.mark.skipif(
    bool(_MISSING_REUSE), reason=f"{' and '.join(_MISSING_REUSE)} not importable (lands with the reuse branch)"
)


class LiveServer:
    """uvicorn serving ``app`` on a free 127.0.0.1 port, in a daemon thread."""

    def __init__(self, app: Any) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def client(self, **kwargs: Any) -> Any:
        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=kwargs.pop("api_key", "none"),
            max_retries=0,
            timeout=kwargs.pop("timeout", 30),
            **kwargs,
        )

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class SlowEngine(Engine):
    """A tiny-model Engine that never stops early (no EOS) and sleeps per token: keeps the worker busy on demand."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(tiny_model("llama"), tiny_tokenizer())
        self.eos_token_ids = []
        self.delay_s = delay_s
        self.emitted: list[int] = []  # tokens produced per request
        self.finished = threading.Event()  # set when a request ends, in any way

    def add(self, request: Any, tag: Any = None) -> Any:
        on_token, count = request.on_token, len(self.emitted)
        self.emitted.append(0)

        def slow(token: int) -> None:
            time.sleep(self.delay_s)
            self.emitted[count] += 1
            if on_token is not None:
                on_token(token)

        request.on_token = slow
        return super().add(request, tag)

    def step(self) -> Any:
        done = super().step()
        if done:
            self.finished.set()
        return done

    def abort(self, seq: Any, error: BaseException) -> None:
        super().abort(seq, error)
        self.finished.set()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model("llama"), tiny_tokenizer())


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[LiveServer]:
    live = LiveServer(create_app(engine, model_name=MODEL, max_queue=8))
    yield live
    live.close()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return server.client()


# ------------------------------------------------------------------------------------------------ generation
def test_models_and_health(server: LiveServer, client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL


def test_completion_is_the_engines_greedy_output(client: Any, engine: Engine) -> None:
    out = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=12, temperature=0)
    expected = engine.generate("The sea is", 12, raw=True)
    assert out.object == "text_completion"
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(engine.encode_chat("The sea is", raw=True))
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    extra = out.model_extra["kvforge"]
    assert extra["reused_tokens"] == 0 and extra["recomputed_tokens"] == out.usage.prompt_tokens
    assert extra["ttft_s"] > 0 and extra["approximate"] is False


def test_chat_completion_and_seeded_sampling(client: Any, engine: Engine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == engine.generate(messages, 10).text
    assert out.usage.prompt_tokens == len(engine.encode_chat(messages))
    sampled = [
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=s)
        .choices[0]
        .message.content
        for s in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1] != sampled[2]


@pytest.mark.parametrize("chat", [True, False])
def test_streaming_equals_non_streaming(client: Any, chat: bool) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, max_tokens=20, temperature=0)
    if chat:
        create = client.chat.completions.create
        kwargs["messages"] = [{"role": "user", "content": "Tell me about the sea."}]
    else:
        create = client.completions.create
        kwargs["prompt"] = "Tell me about the sea."
    full = create(**kwargs)
    text = full.choices[0].message.content if chat else full.choices[0].text
    deltas, finishes, usage = [], [], None
    for event in create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if event.usage is not None:
            usage = event.usage
        for choice in event.choices:
            deltas.append((choice.delta.content or "") if chat else choice.text)
            finishes.append(choice.finish_reason)
    assert "".join(deltas) == text
    assert len([d for d in deltas if d]) > 1  # really streamed, token by token
    assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_stop_string_never_streams(client: Any) -> None:
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    text = base.choices[0].text
    assert len(text) >= 8, "the tiny model should produce some text"
    stop = text[5:8]  # a string the greedy output contains
    cut = text[: text.find(stop)]
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = "".join(
        e.choices[0].text
        for e in client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, stop=stop, stream=True
        )
    )
    assert streamed == cut


# ------------------------------------------------------------------------------------------------ errors
def _error(exc_info: Any) -> dict[str, Any]:
    body = exc_info.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_bad_requests_are_openai_errors(client: Any, engine: Engine) -> None:
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=chat)
    assert _error(e)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=chat, extra_body={"kvforge": {"compression_ratio": 1.0}})
    assert _error(e)["param"] == "kvforge.compression_ratio"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=chat, extra_body={"kvforge": {"press": "nope"}})
    assert _error(e)["param"] == "kvforge.press"
    with pytest.raises(openai.BadRequestError) as e:  # options (some name files) are the operator's, not a client's
        client.chat.completions.create(model=MODEL, messages=chat, extra_body={"kvforge": {"press": "kvzap:model=/x"}})
    assert _error(e)["param"] == "kvforge.press" and "options are set by the server" in _error(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=chat, extra_body={"kvforge": {"reuse": "telepathy"}})
    assert _error(e)["param"] == "kvforge.reuse"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x" * (engine.max_positions + 5), max_tokens=4)
    assert _error(e)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=chat, max_tokens="many")  # type: ignore[arg-type]
    assert _error(e)["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=chat, temperature=-1)
    assert _error(e)["param"] == "temperature"


def test_invalid_json_and_oversized_body(server: LiveServer) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (9 * 2**20)}]}).encode()
    r = httpx.post(server.url + "/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_api_key() -> None:
    live = LiveServer(create_app(Engine(tiny_model("llama"), tiny_tokenizer()), model_name=MODEL, api_key="s3cret"))
    try:
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").models.list()
        assert [m.id for m in live.client(api_key="s3cret").models.list().data] == [MODEL]
        assert httpx.get(live.url + "/health").status_code == 200  # probes need no key
    finally:
        live.close()


# ------------------------------------------------------------------------------------------------ concurrency
def test_full_queue_gives_429_and_disconnect_stops_generation() -> None:
    engine = SlowEngine(delay_s=0.02)
    live = LiveServer(create_app(engine, model_name=MODEL, max_queue=1, scheduler="serial"))
    try:
        client = live.client()
        # 1) a streaming request occupies the model; read a few tokens, then hang up
        stream = client.completions.create(model=MODEL, prompt="abc", max_tokens=2000, temperature=0, stream=True)
        events = iter(stream)
        for _ in range(3):
            next(events)
        # 2) one request waits in the queue (max_queue=1), 3) the next one is refused with Retry-After
        waiting = threading.Thread(
            target=lambda: client.completions.create(model=MODEL, prompt="q", max_tokens=2, temperature=0)
        )
        waiting.start()
        deadline = time.monotonic() + 5
        while live.server.config.app.state.worker.depth < 1 and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="r", max_tokens=2)
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert _error(e)["code"] == "queue_full"
        stream.close()  # the client disconnects
        waiting.join(10)
        assert not waiting.is_alive()
        assert engine.emitted[0] < 500, "the abandoned generation kept running"
        assert engine.emitted[1] == 2  # the queued request ran after it
        metrics = httpx.get(live.url + "/metrics").text
        assert "kvforge_rejected_total 1.0" in metrics
        assert 'kvforge_aborted_total{reason="cancelled"} 1.0' in metrics
    finally:
        live.close()


def test_timeout_gives_504() -> None:
    engine = SlowEngine(delay_s=0.02)
    live = LiveServer(create_app(engine, model_name=MODEL, request_timeout_s=0.5, scheduler="serial"))
    try:
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            live.client().completions.create(model=MODEL, prompt="abc", max_tokens=1000)
        assert e.value.status_code == 504 and _error(e)["code"] == "timeout"
        assert time.monotonic() - start < 3
        assert engine.finished.wait(2) and engine.emitted[0] < 100
        engine.finished.clear()
        stream = live.client().completions.create(model=MODEL, prompt="abc", max_tokens=1000, stream=True)
        with pytest.raises(openai.APIError, match="timed out"):
            for _ in stream:
                pass
        assert engine.finished.wait(2) and engine.emitted[1] < 100
        assert 'kvforge_aborted_total{reason="timeout"} 2.0' in httpx.get(live.url + "/metrics").text
    finally:
        live.close()


def test_metrics_exposition(server: LiveServer, client: Any) -> None:
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    assert 'kvforge_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'kvforge_ttft_seconds_count{endpoint="/v1/completions"}' in text
    assert 'kvforge_request_latency_seconds_bucket{endpoint="/v1/completions",le="+Inf"}' in text
    assert 'kvforge_errors_total{endpoint="/v1/chat/completions",status="400"}' in text  # from the error tests
    assert "kvforge_queue_depth 0.0" in text


# ------------------------------------------------------------------------------------------------ presses / reuse
@needs_presses
def test_per_request_press(client: Any) -> None:
    messages = [{"role": "user", "content": LONG_DOC + "\n\nWhat is the code word of room 3?"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    pressed = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"kvforge": {"press": "snapkv", "compression_ratio": 0.5}},
    )
    kvf, kvf_plain = pressed.model_extra["kvforge"], plain.model_extra["kvforge"]
    assert kvf["press"] == "snapkv" and kvf["compression_ratio"] == 0.5
    assert kvf["cache_bytes"] < 0.75 * kvf_plain["cache_bytes"]
    agnostic = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"kvforge": {"press": "snapkv", "compression_ratio": 0.5, "query_aware": False}},
    )
    assert agnostic.model_extra["kvforge"]["cache_bytes"] < kvf_plain["cache_bytes"]


@needs_reuse
def test_prefix_cache_hit_on_repeated_long_request(client: Any) -> None:
    messages = [{"role": "user", "content": LONG_DOC + "\n\nWhich room has the code word ddd?"}]
    kwargs = dict(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"kvforge": {"reuse": "prefix"}}
    )
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.model_extra["kvforge"]["reuse"] == "prefix"
    assert second.choices[0].message.content == first.choices[0].message.content  # exact reuse: same greedy answer


@needs_reuse
def test_disk_store_hit_after_restart(tmp_path: Any) -> None:
    url = f"file://{tmp_path / 'kv'}"
    messages = [{"role": "user", "content": LONG_DOC + "\n\nWhat is in room 5?"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    answers = []
    for _ in range(2):  # two server lifetimes, fresh engine each, one store folder
        live = LiveServer(
            create_app(Engine(tiny_model("llama"), tiny_tokenizer()), model_name=MODEL, store_url=url, reuse="prefix")
        )
        try:
            answers.append(live.client().chat.completions.create(**kwargs))
        finally:
            live.close()
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    assert answers[1].usage.prompt_tokens_details.cached_tokens > 0
    assert answers[1].choices[0].message.content == answers[0].choices[0].message.content


@needs_reuse
def test_documents_endpoint_precomputes_a_prefix(server: LiveServer, client: Any) -> None:
    doc = LONG_DOC.replace("code word", "password")
    r = httpx.post(server.url + "/v1/kv/documents", json={"model": MODEL, "documents": [doc]}, timeout=30)
    assert r.status_code == 200, r.text
    (entry,) = r.json()["data"]
    assert entry["id"].startswith("kvdoc-") and entry["tokens"] > len(doc)
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": doc + "\n\nWhat is the password of room 2?"}],
        max_tokens=4,
        temperature=0,
        extra_body={"kvforge": {"reuse": "prefix"}},
    )
    assert out.usage.prompt_tokens_details.cached_tokens > 0


@needs_reuse
def test_semantic_hit_reports_approximate_and_similarity() -> None:
    from kvforge.reuse import FakeEmbedder

    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    # a fixed threshold: the bounded default certifies nothing for an embedder without a shipped calibration
    live = LiveServer(create_app(engine, model_name=MODEL, reuse="semantic", embedder=FakeEmbedder(),
                                 semantic={"threshold": 0.9, "verify_ratio": 0.0}))  # fmt: skip
    try:
        client = live.client()
        ask = lambda q: client.chat.completions.create(  # noqa: E731
            model=MODEL, messages=[{"role": "user", "content": LONG_DOC + "\n\n" + q}], max_tokens=4, temperature=0
        )
        first, second = ask("What is the code word of room 7?"), ask("What is the code word of room 7, please?")
        assert first.model_extra["kvforge"]["reuse"] == "miss"
        kvf = second.model_extra["kvforge"]
        assert kvf["reuse"] == "semantic" and kvf["approximate"] is True
        assert 0.9 <= kvf["similarity"] <= 1.0
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        assert (
            'kvforge_reuse_lookups_total{outcome="semantic",strategy="semantic"} 1.0'
            in httpx.get(live.url + "/metrics").text
        )
    finally:
        live.close()


@pytest.mark.skipif(
    not (_have("kvforge.reuse.rag") and _have("kvforge.store")),
    reason="kvforge.reuse.rag / kvforge.store not importable",
)
def test_documents_endpoint_stores_rag_chunks(server: LiveServer) -> None:
    chunks = ["The red door opens at noon.", "The blue door opens at dusk."]
    r = httpx.post(server.url + "/v1/kv/documents", json={"documents": chunks, "mode": "chunks"}, timeout=30)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["tokens"] for d in data] == [len(c) for c in chunks]  # character tokenizer
    store = server.server.config.app.state.features.store
    assert all(store.contains(d["id"]) for d in data)


def test_health_answers_while_a_big_request_is_processed(server: LiveServer) -> None:
    """Parsing and tokenising a big message happens off the event loop, so /health is answered meanwhile."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 2**18}], "max_tokens": 2})
    result: dict[str, Any] = {}

    def slowly() -> Any:  # 1.3 MiB sent in 8 parts over ~0.8 s: the request is surely in flight while /health is asked
        step = len(body) // 8 + 1
        for i in range(0, len(body), step):
            yield body[i : i + step].encode()
            time.sleep(0.1)

    def send() -> None:
        result["r"] = httpx.post(
            server.url + "/v1/chat/completions", content=slowly(), headers={"content-type": "application/json"},
            timeout=120,
        )  # fmt: skip

    sender = threading.Thread(target=send)
    sender.start()
    answered_in_flight = 0
    deadline = time.monotonic() + 120
    while sender.is_alive() and time.monotonic() < deadline:
        r = httpx.get(server.url + "/health", timeout=2.0)  # a blocked event loop makes this raise
        assert r.status_code == 200
        answered_in_flight += sender.is_alive()
        time.sleep(0.05)
    sender.join(120)
    assert result["r"].status_code == 400 and result["r"].json()["error"]["code"] == "context_length_exceeded"
    assert answered_in_flight >= 1


class SlowTokenizingEngine(Engine):
    """Tokenising takes seconds (as a 7 MiB message does with a real tokenizer)."""

    def encode(self, request: Any) -> Any:
        time.sleep(3.0)
        return super().encode(request)


def test_health_answers_while_a_prompt_is_tokenised() -> None:
    """Tokenising runs off the event loop: /health (2 s client timeout) answers during a 3 s tokenisation."""
    live = LiveServer(create_app(SlowTokenizingEngine(tiny_model("llama"), tiny_tokenizer()), model_name=MODEL))
    try:
        result: dict[str, Any] = {}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        sender = threading.Thread(
            target=lambda: result.update(r=httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60))
        )
        sender.start()
        answered_in_flight = 0
        while sender.is_alive():
            assert httpx.get(live.url + "/health", timeout=2.0).status_code == 200
            answered_in_flight += sender.is_alive()
            time.sleep(0.05)
        sender.join(60)
        assert result["r"].status_code == 200 and answered_in_flight >= 1
    finally:
        live.close()
