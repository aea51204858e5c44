"""``kvforge route``: paraphrases rewritten to stored prompts in front of a (fake) vLLM server with the connector.

The fake upstream answers like vLLM (chat, completions, streaming, ``/tokenize``) and, like vLLM with kvforge's
connector, stores the prompt's whole blocks under their prefix-chain keys; embeddings are the hash-based
``FakeEmbedder``. No model, no network.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from kvforge.cli import main
from kvforge.errors import UserError
from kvforge.reuse import FakeEmbedder, PrefixReuse
from kvforge.route import build_normalizer, create_router_app
from kvforge.store import open_store
from kvforge.types import KVSegment
from kvforge.vllm.identity import ServedModel, announce

MODEL = "/models/smol"
MODEL_ID = "LlamaForCausalLM:abc:def:float32"
BLOCK = 16
SYSTEM = {"role": "system", "content": "You answer questions about geography in one short sentence. " * 2}
QUESTION = "What is the capital city of France?"
PARAPHRASE = "what is the capital city of france"  # typed in lower case, no question mark
NEAR_MISS = "What is the capital city of Germany?"


def render(body: dict) -> list[int]:
    """The fake upstream's tokenizer: one token per character of the rendered prompt."""
    text = json.dumps(body["messages"]) if "messages" in body else body["prompt"]
    return [ord(c) % 512 for c in text]


class FakeVLLM:
    """Answers like vLLM; stores every whole block of each prompt it serves, as the kvforge connector does."""

    def __init__(self, store, store_blocks: bool = True) -> None:
        self.store = store
        self.prefix = PrefixReuse(store, MODEL_ID, block_size=BLOCK)
        self.store_blocks = store_blocks
        self.received: list[tuple[str, dict, dict]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        self.received.append((request.url.path, body, dict(request.headers)))
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": render(body), "count": len(render(body))})
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path not in ("/v1/chat/completions", "/v1/completions"):
            return httpx.Response(404, json={"error": "not found"})
        ids = render(body)
        if self.store_blocks:
            for i, key in enumerate(self.prefix.block_keys(ids)[: len(ids) // BLOCK]):
                if not self.store.contains(key):
                    self.store.put(key, block(ids[i * BLOCK : (i + 1) * BLOCK], (i + 1) * BLOCK))
        text = f"answer to {body.get('messages', [{}])[-1].get('content', body.get('prompt'))}"
        if body.get("stream"):
            events = [f"data: {json.dumps({'choices': [{'delta': {'content': w}}]})}\n\n" for w in text.split()]
            return httpx.Response(200, content="".join([*events, "data: [DONE]\n\n"]).encode(),
                                  headers={"content-type": "text/event-stream"})  # fmt: skip
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": text}}],
                                         "usage": {"prompt_tokens": len(ids)}})  # fmt: skip


def block(ids: list[int], end: int) -> KVSegment:
    kv = torch.zeros(1, BLOCK, 4)
    return KVSegment(ids, [kv], [kv], [torch.arange(end - BLOCK, end)[None]], [None], end, MODEL_ID)


@pytest.fixture
def store():
    s = open_store("memory://")
    announce(s, ServedModel(MODEL, MODEL_ID, BLOCK))
    return s


def router(store, upstream: FakeVLLM, **kwargs):
    normalizer = build_normalizer(store, MODEL, threshold=0.6, embedder=FakeEmbedder())
    kwargs = {"record_wait_s": 2.0, **kwargs}
    app = create_router_app(normalizer, "http://vllm.test", transport=httpx.MockTransport(upstream.handler), **kwargs)
    return normalizer, TestClient(app)


def chat(question: str, **extra) -> dict:
    return {"model": "smol", "messages": [SYSTEM, {"role": "user", "content": question}], "max_tokens": 8, **extra}


def wait_recorded(normalizer, n: int = 1) -> None:
    deadline = time.monotonic() + 5
    while len(normalizer.semantic.index) < n:
        assert time.monotonic() < deadline, "the missed prompt was never recorded"
        time.sleep(0.02)


def test_a_paraphrase_is_rewritten_to_the_stored_prompt_and_a_near_miss_is_not(store):
    upstream = FakeVLLM(store)
    normalizer, client = router(store, upstream)
    with client:
        first = client.post("/v1/chat/completions", json=chat(QUESTION))
        assert first.status_code == 200 and first.json()["kvforge"]["route"] == "miss"
        assert first.headers["x-kvforge-route"].startswith("miss")
        wait_recorded(normalizer)

        hit = client.post("/v1/chat/completions", json=chat(PARAPHRASE))
        report = hit.json()["kvforge"]
        assert report["route"] == "hit" and report["donor_prompt"] == QUESTION and report["approximate"] is True
        assert hit.headers["x-kvforge-route"].startswith("hit; similarity=")
        assert upstream.received[-1][1]["messages"][-1]["content"] == QUESTION  # vLLM saw the stored prompt
        assert upstream.received[-1][1]["messages"][0] == SYSTEM

        near = client.post("/v1/chat/completions", json=chat(NEAR_MISS))
        assert near.json()["kvforge"]["route"] == "miss" and "germany" in near.json()["kvforge"]["reason"].lower()
        assert upstream.received[-1][1]["messages"][-1]["content"] == NEAR_MISS

        exact = client.post("/v1/chat/completions", json=chat(QUESTION))
        assert exact.json()["kvforge"]["route"] == "exact"


def test_another_frame_never_matches(store):
    upstream = FakeVLLM(store)
    normalizer, client = router(store, upstream)
    with client:
        client.post("/v1/chat/completions", json=chat(QUESTION))
        wait_recorded(normalizer)
        other = chat(PARAPHRASE)
        other["messages"][0] = {"role": "system", "content": "You are a pirate. " * 8}
        assert client.post("/v1/chat/completions", json=other).json()["kvforge"]["route"] == "miss"
        assert (
            client.post("/v1/chat/completions", json=chat(PARAPHRASE, model="other")).json()["kvforge"]["route"]
            == "miss"
        )


def test_completions_and_streams_are_routed_too(store):
    upstream = FakeVLLM(store)
    normalizer, client = router(store, upstream)
    prompt = "Summarise the geography of France in two sentences, naming its capital city and rivers."
    with client:
        body = {"model": "smol", "prompt": prompt, "max_tokens": 8, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as answer:
            text = b"".join(answer.iter_raw())
            assert answer.headers["x-kvforge-route"] == "miss"
        assert text.endswith(b"data: [DONE]\n\n")
        wait_recorded(normalizer)  # recorded after the stream ended
        again = client.post("/v1/completions", json=body | {"prompt": prompt.lower(), "stream": False})
        assert again.json()["kvforge"]["route"] == "hit"
        assert upstream.received[-1][1]["prompt"] == prompt


def test_evicted_kv_is_a_miss_and_its_entry_is_dropped(store):
    upstream = FakeVLLM(store)
    normalizer, client = router(store, upstream)
    with client:
        client.post("/v1/chat/completions", json=chat(QUESTION))
        wait_recorded(normalizer)
        for key in [k for k in store.keys() if k.startswith("prefix-")]:  # noqa: SIM118 (a store, not a dict)
            store.delete(key)
        answer = client.post("/v1/chat/completions", json=chat(PARAPHRASE))
        assert answer.json()["kvforge"]["route"] == "miss"
        assert upstream.received[-1][1]["messages"][-1]["content"] == PARAPHRASE
        assert len(normalizer.semantic.index) <= 1  # only the paraphrase's own new record, once stored


def test_nothing_is_recorded_without_stored_blocks(store):
    upstream = FakeVLLM(store, store_blocks=False)  # vLLM without the connector (or on another store)
    normalizer, client = router(store, upstream, record_wait_s=0.2)
    with client:
        client.post("/v1/chat/completions", json=chat(QUESTION))
        time.sleep(0.6)
        assert client.post("/v1/chat/completions", json=chat(PARAPHRASE)).json()["kvforge"]["route"] == "miss"
    assert len(normalizer.semantic.index) == 0


def test_records_are_in_the_store_for_every_router(store):
    upstream = FakeVLLM(store)
    normalizer, client = router(store, upstream)
    with client:
        client.post("/v1/chat/completions", json=chat(QUESTION))
        wait_recorded(normalizer)
    _, client2 = router(store, upstream)  # another router process on the same store
    with client2:
        assert client2.post("/v1/chat/completions", json=chat(PARAPHRASE)).json()["kvforge"]["route"] == "hit"


def test_opt_out_and_unmatched_requests_pass_through(store):
    upstream = FakeVLLM(store)
    _, client = router(store, upstream)
    with client:
        answer = client.post("/v1/chat/completions", json=chat(QUESTION, kvforge={"route": False}))
        assert answer.json()["kvforge"]["route"] == "skip" and "kvforge" not in upstream.received[-1][1]
        tools = chat(QUESTION)
        tools["messages"].append({"role": "assistant", "content": "Paris."})
        assert client.post("/v1/chat/completions", json=tools).json()["kvforge"]["route"] == "skip"
        assert client.get("/v1/models").status_code == 404  # other paths forwarded as they are (fake has none)
        assert client.post("/v1/chat/completions", content=b"{nope").status_code == 400


def test_api_keys_stay_where_they_belong(store):
    upstream = FakeVLLM(store)
    _, client = router(store, upstream, api_key="router-key", upstream_api_key="vllm-key")
    with client:
        assert client.post("/v1/chat/completions", json=chat(QUESTION)).status_code == 401
        ok = client.post("/v1/chat/completions", json=chat(QUESTION), headers={"Authorization": "Bearer router-key"})
        assert ok.status_code == 200
        assert upstream.received[-1][2]["authorization"] == "Bearer vllm-key"
        assert client.get("/metrics").status_code == 200  # open: scrapers
        assert b'kvforge_route_decisions_total{result="miss"}' in client.get("/metrics").content


def test_an_unreachable_upstream_is_a_502(store):
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    normalizer = build_normalizer(store, MODEL, embedder=FakeEmbedder())
    app = create_router_app(normalizer, "http://vllm.test", transport=httpx.MockTransport(down))
    with TestClient(app) as client:
        answer = client.post("/v1/chat/completions", json=chat(QUESTION))
        assert answer.status_code == 502 and "unreachable" in answer.json()["error"]["message"]
        assert client.get("/health").status_code == 503


def test_a_store_without_the_connector_is_refused_at_start():
    with pytest.raises(UserError, match="no vLLM server with kvforge's connector"):
        build_normalizer(open_store("memory://"), MODEL, embedder=FakeEmbedder())


def test_cli_fails_in_one_line_when_the_upstream_is_down(capsys):
    code = main(["route", "--upstream", "http://127.0.0.1:9", "--upstream-wait", "0", "--store", "memory://"])
    assert code == 2
    assert "does not answer /v1/models" in capsys.readouterr().err


PASSWORD = "Upstr3am-PW"


def test_the_upstream_password_never_leaves_the_router(store, capsys):
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"refused by {request.url}")

    normalizer = build_normalizer(store, MODEL, embedder=FakeEmbedder())
    url = f"http://admin:{PASSWORD}@vllm.test"
    app = create_router_app(normalizer, url, transport=httpx.MockTransport(down))
    with TestClient(app) as client:
        for answer in (client.post("/v1/chat/completions", json=chat(QUESTION)), client.get("/v1/models"),
                       client.get("/health")):  # fmt: skip
            assert answer.status_code in (502, 503) and PASSWORD not in answer.text, answer.text
            assert "***@vllm.test" in answer.text
    code = main(["route", "--upstream", f"http://admin:{PASSWORD}@127.0.0.1:9", "--upstream-wait", "0",
                 "--store", "memory://"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 2 and PASSWORD not in out.out + out.err


class BrokenStream(httpx.AsyncByteStream):
    """A body that yields ``first`` then fails (a reset or a stall, as httpx reports them)."""

    def __init__(self, first: bytes, error: Exception) -> None:
        self.first, self.error = first, error

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        yield self.first
        raise self.error


@pytest.mark.parametrize("error", [httpx.RemoteProtocolError("peer closed connection"), httpx.ReadTimeout("stall")])
def test_an_upstream_that_fails_mid_answer_is_a_502_or_an_sse_error_then_done(store, error):
    def cut(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        first = b'data: {"choices": [{"delta": {"content": "Par"}}]}\n\n' if body.get("stream") else b'{"choi'
        return httpx.Response(200, stream=BrokenStream(first, error), headers={"content-type": "application/json"})

    normalizer = build_normalizer(store, MODEL, embedder=FakeEmbedder())
    app = create_router_app(normalizer, "http://vllm.test", transport=httpx.MockTransport(cut))
    with TestClient(app) as client:
        answer = client.post("/v1/chat/completions", json=chat(QUESTION))
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_unavailable"
        streamed = client.post("/v1/chat/completions", json=chat(QUESTION, stream=True))
        events = [e for e in streamed.text.split("\n\n") if e.strip()]
        assert events[0].startswith('data: {"choices"')
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "upstream_unavailable"
        assert events[-1] == "data: [DONE]"


def test_keys_are_utf8_and_an_empty_key_is_refused(store, capsys, monkeypatch):
    upstream = FakeVLLM(store)
    _, client = router(store, upstream, api_key="clé-ключ-鍵")
    with client:
        sent = {"Authorization": "Bearer clé-ключ-鍵".encode()}
        assert client.post("/v1/chat/completions", json=chat(QUESTION), headers=sent).status_code == 200
        latin1 = {"Authorization": "Bearer clé-ключ-鍵".encode().decode("latin-1").encode("utf-8")}
        assert client.post("/v1/chat/completions", json=chat(QUESTION), headers=latin1).status_code == 401
        assert client.post("/v1/chat/completions", json=chat(QUESTION),
                           headers={"Authorization": "Bearer"}).status_code == 401  # fmt: skip
    with pytest.raises(UserError, match="empty"):
        router(store, upstream, api_key=" ")
    from kvforge.engine import Engine
    from kvforge.serve import create_app
    from kvforge.testing import tiny_model, tiny_tokenizer

    with pytest.raises(UserError, match="empty"):  # at once, not at the first request
        create_app(Engine(tiny_model("llama"), tiny_tokenizer()), api_key="")
    monkeypatch.setenv("KVFORGE_API_KEY", "")
    for argv in (["route", "--upstream", "http://127.0.0.1:9"], ["serve", "--model", "smollm2-135m"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "API key is empty" in err and len(err.strip().splitlines()) == 1
