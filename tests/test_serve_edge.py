"""The schema edge: ids, counts and sampling parameters are checked (or normalised) before the engine sees them, so
odd values are one-line 400s and tiny temperatures are greedy answers, never a 500 (TestClient, tiny model)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from kvforge.decode import MIN_TEMPERATURE, SamplingParams, sample
from kvforge.engine import Engine
from kvforge.serve import create_app
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


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-320, MIN_TEMPERATURE / 2])
def test_tiny_temperatures_are_greedy(client: Any, temperature: float) -> None:
    greedy = client.post("/v1/chat/completions", json=_chat(temperature=0))
    tiny = client.post("/v1/chat/completions", json=_chat(temperature=temperature, seed=3))
    assert greedy.status_code == tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]


def test_the_sampler_treats_temperatures_below_the_floor_as_greedy() -> None:
    import torch

    logits = torch.tensor([[1.0, 3.0, 2.0], [30.0, -5.0, 29.9]])
    for t in (1e-38, 1e-45, 5e-324, 0.0):
        assert sample(logits, SamplingParams(temperature=t)).tolist() == [1, 0]
    assert not SamplingParams(temperature=MIN_TEMPERATURE).is_greedy  # the floor itself samples (finite scores)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat(max_tokens=2**40), "max_tokens"),
        (_chat(max_completion_tokens=0), "max_completion_tokens"),
        (_chat(temperature=-1e-320), "temperature"),
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
