"""OpenAI fields through the stock ``openai`` client: max_completion_tokens, logprobs, penalties, unsupported fields."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from test_serve import MODEL, LiveServer  # noqa: E402

from kvforge.decode import PresenceFrequencyPenalty  # noqa: E402
from kvforge.engine import Engine  # noqa: E402
from kvforge.request import Request  # noqa: E402
from kvforge.serve import create_app  # noqa: E402
from kvforge.testing import tiny_model, tiny_tokenizer  # noqa: E402

CHAT = [{"role": "user", "content": "Say something long about the sea."}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    engine.eos_token_ids = []  # answers run to their budget
    return engine


def _twin(engine: Engine) -> Engine:
    """Another engine on the same model (an engine is stepped by one thread at a time)."""
    twin = Engine(engine.model, engine.tokenizer)
    twin.eos_token_ids = engine.eos_token_ids
    return twin


@pytest.fixture(scope="module")
def live(engine: Engine) -> Iterator[LiveServer]:
    server = LiveServer(create_app(engine, model_name=MODEL))
    yield server
    server.close()


def test_max_completion_tokens(live: LiveServer) -> None:
    out = live.client().chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_chat_logprobs_and_top_logprobs(live: LiveServer, engine: Engine) -> None:
    out = live.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.logprob <= 0
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)  # greedy
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
    probs = torch.tensor([t.logprob for t in content[0].top_logprobs]).exp()
    assert float(probs.sum()) <= 1.0 + 1e-5


def test_completion_logprobs(live: LiveServer) -> None:
    out = live.client().completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_penalties_are_the_logits_processor_applied_per_token(live: LiveServer, engine: Engine) -> None:
    client = live.client()
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    penalised = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, frequency_penalty=2.0, presence_penalty=1.0
    )
    # the same penalties applied by the library, alone (another engine: the server's is its model thread's)
    alone = _twin(engine).run(Request(CHAT, 24, processors=[PresenceFrequencyPenalty(1.0, 2.0)]))
    assert penalised.choices[0].message.content == alone.text
    assert penalised.choices[0].message.content != plain.choices[0].message.content


def test_penalty_math() -> None:
    scores = torch.zeros(1, 5)
    out = PresenceFrequencyPenalty(presence=0.5, frequency=1.0)(torch.tensor([[1, 1, 3]]), scores)
    assert out.tolist() == [[0.0, -2.5, 0.0, -1.5, 0.0]]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 2}, "n"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"service_tier": "auto"}, "service_tier"),
    ],
)
def test_unsupported_chat_field_is_a_400_naming_it(live: LiveServer, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **kwargs)
    assert field in e.value.message and e.value.body["param"] == field  # type: ignore[index]


@pytest.mark.parametrize(("kwargs", "field"), [({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of")])
def test_unsupported_completion_field_is_a_400_naming_it(live: LiveServer, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        live.client().completions.create(model=MODEL, prompt="a", max_tokens=2, **kwargs)
    assert field in e.value.message


def test_logprobs_with_stream_is_a_400(live: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, stream=True)
    assert "logprobs" in e.value.message


def test_stream_options_without_stream_is_a_400(live: LiveServer) -> None:
    for create, kwargs in ((live.client().chat.completions.create, {"messages": CHAT}),
                           (live.client().completions.create, {"prompt": "a"})):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, max_tokens=2, stream_options={"include_usage": True}, **kwargs)
        assert e.value.body["param"] == "stream_options"  # type: ignore[index]


def test_serial_scheduler_applies_penalties_as_the_batched_one(live: LiveServer, engine: Engine) -> None:
    server = LiveServer(create_app(_twin(engine), model_name=MODEL, scheduler="serial"))
    try:
        ask = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0, "presence_penalty": 1.0}
        serial = server.client().chat.completions.create(**ask)
        assert (
            serial.choices[0].message.content == live.client().chat.completions.create(**ask).choices[0].message.content
        )
    finally:
        server.close()


def test_vllm_named_metrics(engine: Engine) -> None:
    import httpx

    server = LiveServer(create_app(engine, model_name=MODEL, reuse="prefix", store_url="memory://"))
    try:
        client = server.client()
        for _ in range(2):
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
        text = httpx.get(server.url + "/metrics").text
        values = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:")
        }
        label = '{model_name="tiny"}'
        assert values[f"vllm:time_to_first_token_seconds_count{label}"] == 2
        assert values[f"vllm:e2e_request_latency_seconds_count{label}"] == 2
        assert values[f"vllm:inter_token_latency_seconds_count{label}"] == 2 * 4  # 5 tokens: 4 gaps each
        assert values[f"vllm:generation_tokens_total{label}"] == 10
        queries, hits = (
            values[f"vllm:prefix_cache_queries_total{label}"],
            values[f"vllm:prefix_cache_hits_total{label}"],
        )
        assert queries == values[f"vllm:prompt_tokens_total{label}"] and 0 < hits < queries  # the 2nd one hits
        assert values[f"vllm:num_requests_running{label}"] == 0 and values[f"vllm:num_requests_waiting{label}"] == 0
    finally:
        server.close()
