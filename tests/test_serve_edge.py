"""The schema edge: ids, counts and sampling parameters are checked (or normalised) before the engine sees them, so
odd values (tiny temperatures among them) are one-line 400s, never a 500, and large bodies are refused from their sizes
off the event loop (TestClient, tiny model)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from kvforge.decode import MIN_TEMPERATURE, SamplingParams, sample
from kvforge.engine import Engine
from kvforge.errors import UserError
from kvforge.serve import create_app
from kvforge.serve.state import LARGE_BODY_BYTES
from kvforge.testing import tiny_model, tiny_tokenizer

MODEL = "tiny"


@pytest.fixture(scope="module")
def client() -> Any:
    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    with TestClient(create_app(engine, model_name=MODEL, store_url="memory://")) as c:
        yield c


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Where is the key?"}], "max_tokens": 6} | extra


def _one_line_400(r: Any, param: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"] and len(error["message"]) < 400, error
    return error  # type: ignore[no-any-return]


@pytest.mark.parametrize("chunk_id", ["../../etc/passwd", "", "a\x00b", "*", "x" * 10_000, ".hidden", "a/b", "é"])
def test_odd_chunk_ids_are_one_line_400s(client: Any, chunk_id: str) -> None:
    body = _chat(kvforge={"rag": "naive", "chunk_ids": [chunk_id]})
    _one_line_400(client.post("/v1/chat/completions", json=body), "kvforge.chunk_ids")


def test_an_unknown_but_valid_chunk_id_is_a_400_naming_it(client: Any) -> None:
    body = _chat(kvforge={"rag": "naive", "chunk_ids": ["f" * 64]})
    error = _one_line_400(client.post("/v1/chat/completions", json=body), "kvforge.chunk_ids[0]")
    assert "unknown chunk id" in error["message"]


TINY_TEMPERATURES = [1e-38, 1e-45, 1e-320, 5e-324, MIN_TEMPERATURE / 2, -0.5, float("inf")]


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-320, MIN_TEMPERATURE / 2])
def test_tiny_temperatures_are_one_line_400s_that_say_the_rule(client: Any, temperature: float) -> None:
    error = _one_line_400(client.post("/v1/chat/completions", json=_chat(temperature=temperature, seed=3)),
                          "temperature")  # fmt: skip
    assert "temperature must be 0 (greedy) or at least 1e-05" in error["message"], error
    raw = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "temperature": temperature})
    assert _one_line_400(raw, "temperature")["message"] == error["message"]


def test_temperature_zero_and_the_floor_are_answered(client: Any) -> None:
    for t in (0, 0.0, MIN_TEMPERATURE, 2.0):
        r = client.post("/v1/chat/completions", json=_chat(temperature=t, seed=3))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_sampling_params_refuse_what_the_server_refuses_with_the_same_message(temperature: float) -> None:
    """One rule (kvforge.sampling): the Python API (``SamplingParams``, so ``Request``) gives the server's message."""
    with pytest.raises(UserError, match=r"^temperature must be 0 \(greedy\) or at least 1e-05, got "):
        SamplingParams(temperature=temperature)


def test_the_floor_itself_samples_with_finite_scores() -> None:
    import torch

    logits = torch.tensor([[1.0, 3.0, 2.0], [30.0, -5.0, 29.9]])
    assert sample(logits, SamplingParams(temperature=0.0)).tolist() == [1, 0]
    params = SamplingParams(temperature=MIN_TEMPERATURE, seed=1)
    assert not params.is_greedy
    g = torch.Generator().manual_seed(1)
    assert sample(logits, params, g).tolist() == [1, 0]  # 1e-5 scales the gaps to 1e4+: the argmax, no NaN


@pytest.mark.parametrize("where", ["argument", "config", "environment"])
def test_the_cli_refuses_a_tiny_temperature_in_one_line_before_loading_a_model(
    tmp_path: Any, capsys: Any, monkeypatch: Any, where: str
) -> None:
    from kvforge import cli

    argv = ["generate", "--model", "no-such-model-folder", "--prompt", "hi"]
    if where == "argument":
        argv += ["--temperature", "1e-38"]
    elif where == "config":
        (tmp_path / "kvforge.toml").write_text("[generate]\ntemperature = 1e-38\n")
        argv = ["--config", str(tmp_path / "kvforge.toml"), *argv]
    else:
        monkeypatch.setenv("KVFORGE_TEMPERATURE", "1e-38")
    assert cli.main(argv) == 2  # not the unknown model: the temperature is checked first
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "temperature must be 0 (greedy) or at least 1e-05, got 1e-38" in err, err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat(max_tokens=2**40), "max_tokens"),
        (_chat(max_completion_tokens=0), "max_completion_tokens"),
        (_chat(temperature=-1e-320), "temperature"),
        (_chat(temperature=2.5), "temperature"),
        (_chat(top_p=0.0), "top_p"),
        (_chat(kvforge={"press": "x" * 1000}), "kvforge.press"),
        (_chat(kvforge={"quant": ""}), "kvforge.quant"),
    ],
)
def test_out_of_range_values_are_one_line_400s(client: Any, body: dict[str, Any], param: str) -> None:
    _one_line_400(client.post("/v1/chat/completions", json=body), param)


@pytest.mark.parametrize("prompt", [[-1, 5], [5, 2**40], [[3, -7]]])
def test_token_ids_out_of_range_are_400s(client: Any, prompt: Any) -> None:
    _one_line_400(client.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), "prompt")


def test_documents_with_an_odd_press_name_are_400(client: Any) -> None:
    body = {"documents": ["some text"], "press": "y" * 500}
    _one_line_400(client.post("/v1/kv/documents", json=body), "press")
    body = {"documents": ["some text"], "press": "kvzap:model=/etc/passwd"}  # options are the operator's
    error = _one_line_400(client.post("/v1/kv/documents", json=body), "press")
    assert "options are set by the server" in error["message"]


def test_the_operators_default_press_takes_options() -> None:
    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    with TestClient(create_app(engine, model_name=MODEL, press="snapkv:window_size=8", compression_ratio=0.5)) as c:
        r = c.post("/v1/chat/completions", json=_chat(max_tokens=2))
        assert r.status_code == 200 and r.json()["kvforge"]["press"] == "snapkv:window_size=8", r.text
    with pytest.raises(UserError, match="no option windw"):
        create_app(engine, model_name=MODEL, press="snapkv:windw=8")


def test_ignore_eos_generates_max_tokens_past_the_end_of_sequence(client: Any) -> None:
    """vLLM's ``ignore_eos``: the end-of-sequence token does not end the answer (what load tests need). The greedy
    answer of a prompt that ends at once on </s> is made exactly max_tokens long."""
    for prompt in (f"{i} {chr(97 + i)}" for i in range(40)):
        plain = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 40,
                                                     "temperature": 0})  # fmt: skip
        assert plain.status_code == 200, plain.text
        if plain.json()["choices"][0]["finish_reason"] == "stop":
            break
    else:
        pytest.skip("no greedy answer of this tiny model ends on </s> within 40 tokens")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    forced = client.post("/v1/completions", json=body).json()
    assert forced["choices"][0]["finish_reason"] == "length"
    assert forced["usage"]["completion_tokens"] == 40 > plain.json()["usage"]["completion_tokens"]
    assert client.post("/v1/completions", json=body | {"ignore_eos": "yes"}).status_code == 400


# ------------------------------------------------------------------------------------------------ large bodies
_MANY_IDS = [i * 7919 % 1000 for i in range(2**20)]  # ~5 MiB of token ids as JSON, 512x the tiny model's context


def _big(body: dict[str, Any]) -> bytes:
    import json

    raw = json.dumps(body).encode()
    assert len(raw) > LARGE_BODY_BYTES
    return raw


def _post_raw(client: Any, path: str, raw: bytes) -> Any:
    return client.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": _MANY_IDS}, "prompt", "prompt of at least"),
        ("/v1/completions", {"model": MODEL, "prompt": [_MANY_IDS]}, "prompt", "prompt of at least"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 2**17},
         "messages", "at least"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 2**17}]},
         "messages", "prompt of 655360 characters"),
        ("/v1/kv/documents", {"documents": ["a", "word " * 2**17]}, "documents[1]", "document of 655360 characters"),
    ],
)
def test_large_bodies_are_refused_from_their_sizes_before_the_schema_validates_them(
    client: Any, monkeypatch: Any, path: str, body: dict[str, Any], param: str, message: str
) -> None:
    """A prompt, chat or document surely longer than the context is a one-line 400 found from sizes alone: the schema
    never validates its million token ids or messages one by one."""
    from kvforge.serve import schemas as S

    validated: list[str] = []
    for model in (S.CompletionRequest, S.ChatCompletionRequest, S.DocumentsRequest):
        real = model.model_validate_json
        monkeypatch.setattr(model, "model_validate_json", lambda raw, _real=real, **kw: validated.append("x") or
                            _real(raw, **kw))  # fmt: skip
    error = _one_line_400(_post_raw(client, path, _big(body)), param)
    assert error["code"] == "context_length_exceeded" and message in error["message"], error
    assert validated == []


def test_a_token_list_is_refused_from_the_first_prefix_of_the_body() -> None:
    """``check_sizes`` parses growing prefixes: a million ids are refused after the first 64 KiB, whose sizes are
    lower bounds (a string cut off is left out, so a model name is never read cut short)."""
    import json

    from kvforge.serve.state import check_sizes

    seen: list[tuple[Any, bool]] = []

    def check(value: Any, partial: bool) -> None:
        seen.append((value, partial))
        if len(value.get("prompt", [])) > 2048:
            raise ValueError("too long")

    with pytest.raises(ValueError, match="too long"):
        check_sizes(json.dumps({"model": MODEL, "prompt": _MANY_IDS}).encode(), check)
    assert len(seen) == 1 and seen[0][1] is True and 2048 < len(seen[0][0]["prompt"]) < 2**20
    seen.clear()
    check_sizes(json.dumps({"model": "m" * 2**17, "prompt": [1, 2]}).encode(), check, first=1000)
    assert [("model" in v, partial) for v, partial in seen] == [(False, True)] * 4 + [(True, False)]  # 1, 4, 16, 64 kB
    assert seen[-1][0] == {"model": "m" * 2**17, "prompt": [1, 2]}


def test_a_large_body_that_fits_is_answered(client: Any) -> None:
    """The size check refuses only what is surely too long: a 300 KiB body whose prompt fits is answered, one that
    names another model is the 404, and a token list one over the context gets the exact count."""
    pad = "u" * (300 * 2**10)  # the `user` field: accepted, changes no output
    ok = _post_raw(client, "/v1/chat/completions", _big(_chat(user=pad)))
    assert ok.status_code == 200, ok.text
    other = _post_raw(client, "/v1/chat/completions", _big(_chat(user=pad, model="gpt-9")))
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    over = _post_raw(client, "/v1/completions", _big({"user": pad, "model": MODEL, "prompt": [5] * 2049}))
    assert _one_line_400(over, "prompt")["message"].startswith("prompt of 2049 tokens")  # seen whole: exact
    early = _post_raw(client, "/v1/completions", _big({"model": MODEL, "prompt": [5] * 2049, "user": pad}))
    assert _one_line_400(early, "prompt")["message"].startswith("prompt of at least 2049 tokens")  # in a prefix


def test_a_large_body_is_checked_off_the_event_loop(monkeypatch: Any) -> None:
    """While a large body's sizes are checked, the server answers /health: the check waits until /health has been
    answered, which could never happen if it ran on the event loop (it would time out, and the test fail)."""
    import asyncio
    import threading

    import httpx

    from kvforge.serve import state

    entered, gate, released = threading.Event(), threading.Event(), []
    real = state.check_sizes

    def waiting(body: bytes, check: Any) -> None:
        entered.set()
        released.append(gate.wait(10))  # on the event loop, nothing could set the gate: False after 10 s
        real(body, check)

    monkeypatch.setattr(state, "check_sizes", waiting)
    app = create_app(Engine(tiny_model("llama"), tiny_tokenizer()), model_name=MODEL)

    async def scenario() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvforge") as c:
            big = asyncio.ensure_future(c.post("/v1/completions", content=_big({"model": MODEL, "prompt": _MANY_IDS}),
                                               headers={"content-type": "application/json"}))  # fmt: skip
            while not entered.is_set() and not big.done():
                await asyncio.sleep(0.01)
            health = await c.get("/health")
            gate.set()
            return health.status_code, (await big).status_code

    try:
        health, status = asyncio.run(scenario())
    finally:
        app.state.server.close()
    assert released == [True] and health == 200 and status == 400
