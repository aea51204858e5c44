"""The batching scheduler, live: concurrent requests answer as they would alone, prefill interleaves with streaming,
a client that leaves stops its prefill at the next chunk, a full batch queue is a 429."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import MODEL, LiveServer  # noqa: E402

from kvforge.engine import Engine  # noqa: E402
from kvforge.serve import create_app  # noqa: E402
from kvforge.testing import tiny_model, tiny_tokenizer  # noqa: E402

PROMPTS = ["hello there", "abc " * 30, "x", "The quick brown fox jumps over the lazy dog. " * 4, "zzz\nyyy", "12345"]


class SpyEngine(Engine):
    """The tiny model with no EOS: every answer runs to max_tokens."""

    def __init__(self, arch: str = "llama", chunk_size: int = 512) -> None:
        super().__init__(tiny_model(arch), tiny_tokenizer(), chunk_size=chunk_size)
        self.eos_token_ids = []


def _slow_forward(model: Any, delay_s: float) -> None:
    model.register_forward_pre_hook(lambda module, args: time.sleep(delay_s))


def _spy_chunks(live: LiveServer) -> list[tuple[float, int]]:
    """(time, tokens) of every prompt chunk the engine puts into a step from now on."""
    engine = live.server.config.app.state.engine  # type: ignore[union-attr]
    seen: list[tuple[float, int]] = []
    real = engine.schedule

    def spy(*args: Any) -> Any:
        chosen = real(*args)
        seen.extend((time.monotonic(), n) for _, n in chosen)
        return chosen

    engine.schedule = spy
    return seen


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_concurrent_requests_answer_as_alone(arch: str) -> None:
    engine = SpyEngine(arch=arch)
    alone = [engine.generate(p, 12, raw=True).text for p in PROMPTS]
    live = LiveServer(create_app(engine, model_name=MODEL, max_running=8, prefill_budget=16))
    try:
        client = live.client()
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            if i % 2:  # half of them stream
                chunks = client.completions.create(
                    model=MODEL, prompt=PROMPTS[i], max_tokens=12, temperature=0, stream=True
                )
                answers[i] = "".join(c.choices[0].text for c in chunks)
            else:
                answers[i] = (
                    client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=12, temperature=0)
                    .choices[0]
                    .text
                )

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [answers.get(i) for i in range(len(PROMPTS))] == alone
    finally:
        live.close()


def test_prefix_reuse_through_the_batch_is_a_hit_with_the_same_answer() -> None:
    live = LiveServer(create_app(SpyEngine(), model_name=MODEL, reuse="prefix", store_url="memory://"))
    try:
        client = live.client()
        messages = [{"role": "user", "content": "Some long document. " * 30 + "\n\nWhat is it?"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        assert second.choices[0].message.content == first.choices[0].message.content
    finally:
        live.close()


def test_streaming_continues_while_a_long_prompt_is_prefilled() -> None:
    """The long prompt is prefilled in chunks; the streaming request gets tokens between its first and last chunk."""
    engine = SpyEngine()
    _slow_forward(engine.model, 0.02)  # the stream lasts > 8 s
    live = LiveServer(create_app(engine, model_name=MODEL, prefill_budget=8))
    try:
        prefills = _spy_chunks(live)
        client = live.client()
        token_times: list[float] = []

        def stream() -> None:
            for _ in client.completions.create(model=MODEL, prompt="hi", max_tokens=400, temperature=0, stream=True):
                token_times.append(time.monotonic())

        streamer = threading.Thread(target=stream)
        streamer.start()
        while len(token_times) < 3:
            time.sleep(0.01)
        num_before = len(prefills)
        long = client.completions.create(model=MODEL, prompt="a" * 120, max_tokens=2, temperature=0)
        assert long.usage.prompt_tokens >= 120
        chunks = prefills[num_before:]
        assert len(chunks) >= 15 and max(n for _, n in chunks) <= 8  # budgeted chunks
        first, last = chunks[0][0], chunks[-1][0]
        assert sum(first < t < last for t in token_times) >= 5  # tokens kept flowing during the long prefill
        streamer.join(60)
    finally:
        live.close()


def test_client_that_leaves_stops_its_prefill_at_the_next_chunk() -> None:
    engine = SpyEngine(chunk_size=4)  # alone, a prompt runs in the engine's chunks
    _slow_forward(engine.model, 0.1)
    live = LiveServer(create_app(engine, model_name=MODEL, prefill_budget=4))
    try:
        prefills = _spy_chunks(live)
        body = {"model": MODEL, "prompt": "b" * 200, "max_tokens": 2}  # 50 chunks of 0.1 s
        with pytest.raises(httpx.TimeoutException):
            httpx.post(live.url + "/v1/completions", json=body, timeout=1.0)
        time.sleep(1.5)
        num = len(prefills)
        time.sleep(0.5)
        assert len(prefills) == num < 30  # stopped, well before the end
        assert live.server.config.app.state.worker.num_running == 0  # type: ignore[union-attr]
    finally:
        live.close()


def test_full_batch_queue_gives_429() -> None:
    engine = SpyEngine()
    _slow_forward(engine.model, 0.02)
    live = LiveServer(create_app(engine, model_name=MODEL, max_running=1, max_queue=1))
    try:
        client = live.client()
        stream = client.completions.create(model=MODEL, prompt="a", max_tokens=500, temperature=0, stream=True)
        next(iter(stream))
        waiting = threading.Thread(target=lambda: client.completions.create(model=MODEL, prompt="q", max_tokens=2))
        waiting.start()
        worker = live.server.config.app.state.worker  # type: ignore[union-attr]
        deadline = time.monotonic() + 5
        while worker.depth < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="r", max_tokens=2)
        assert e.value.response.headers["retry-after"]
        stream.close()  # the client hangs up: its place in the batch goes to the waiting request
        waiting.join(30)
        assert not waiting.is_alive()
    finally:
        live.close()


def test_batch_refuses_what_would_time_out() -> None:
    """A 429 at once beats a 504 later: a request whose deadline is shorter than the expected time is refused."""
    import asyncio

    from kvforge.request import Request
    from kvforge.serve.jobs import QueueFullError
    from kvforge.serve.scheduler import Scheduler

    scheduler = Scheduler(SpyEngine(), max_queue=4, max_running=1)
    loop = asyncio.new_event_loop()
    try:
        scheduler.num_done, scheduler.avg_job_s, scheduler.finish_rate = 5, 10.0, 0.1  # 10 s per request measured
        with pytest.raises(QueueFullError):
            scheduler.submit_request(Request("a", max_new_tokens=2, raw=True), loop, timeout_s=5.0)
        job = scheduler.submit_request(Request("a", max_new_tokens=2, raw=True), loop, timeout_s=100.0)
        assert job.deadline > time.monotonic()
    finally:
        scheduler.close()
        loop.close()


def test_a_failed_step_answers_its_requests_with_an_error_and_the_batch_goes_on() -> None:
    """The step's forward raises once: the requests in that step get a 500, the next requests are answered."""
    engine = SpyEngine()
    calls = {"n": 0}

    def fail_once(module: Any, args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # inside a batched step (the first forwards are the prompts' chunks)
            raise RuntimeError("boom")

    engine.model.register_forward_pre_hook(fail_once)
    live = LiveServer(create_app(engine, model_name=MODEL))
    try:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0}
        failed = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
        assert failed.status_code == 500
        again = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
        assert live.server.config.app.state.worker.num_running == 0  # type: ignore[union-attr]
    finally:
        live.close()
