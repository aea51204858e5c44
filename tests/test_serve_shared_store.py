"""Several servers, one store: a document stored or a prompt prefilled through one server is a hit on another.

Redis: two real ``kvforge serve`` processes (a tiny model saved to a folder) on one real redis-server. ``file://``:
two apps in this process, each with its own engine and its own handle on the folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from store_helpers import free_port, redis_server  # noqa: E402
from test_serve import LONG_DOC, MODEL, LiveServer  # noqa: E402

from kvforge.engine import Engine  # noqa: E402
from kvforge.serve import create_app  # noqa: E402
from kvforge.testing import tiny_model, tiny_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _chat(url: str, content: str) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _store_document(url: str, doc: str) -> None:
    r = httpx.post(url + "/v1/kv/documents", json={"model": MODEL, "documents": [doc]}, timeout=60)
    assert r.status_code == 200, r.text


def _check_sharing(a: str, b: str) -> None:
    """A document stored through ``a`` and a prompt answered by ``a`` are hits on ``b``, with the same answers."""
    doc = LONG_DOC.replace("code word", "shared secret")
    _store_document(a, doc)
    on_b = _chat(b, doc + "\n\nWhat is the shared secret of room 3?")
    assert on_b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    prompt = LONG_DOC + "\n\nWhich room has the code word ccc?"
    first = _chat(a, prompt)
    second = _chat(b, prompt)
    # the chat template's opening + "Fact 0: the " (characters: the tiny tokenizer's tokens)
    shared = len("<u>" + os.path.commonprefix([doc, LONG_DOC]))  # noqa: RUF071
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == shared  # reused to the last matching token
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_two_apps_share_one_file_store(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'kv'}"
    model = tiny_model("llama")
    servers = [
        LiveServer(create_app(Engine(model, tiny_tokenizer()), model_name=MODEL, store_url=url, reuse="prefix"))
        for _ in range(2)
    ]
    try:
        _check_sharing(servers[0].url, servers[1].url)
    finally:
        for s in servers:
            s.close()


@pytest.fixture()
def model_dir(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir  # conftest's saved tiny Llama folder


def _serve(model_dir: Path, store: str, port: int, reuse: str = "prefix") -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "kvforge",
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--port",
        str(port),
        "--store",
        store,
        "--reuse",
        reuse,
    ]
    env = os.environ | {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("server did not start")


@contextmanager
def two_servers(model_dir: Path, store: str, reuse: str = "prefix") -> Iterator[tuple[str, str]]:
    """Two ``kvforge serve`` processes on ``store``; yields their URLs."""
    ports = [free_port(), free_port()]
    procs = [_serve(model_dir, store, port, reuse) for port in ports]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url, proc in zip(urls, procs, strict=True):
            _wait_healthy(url, proc)
        yield urls[0], urls[1]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture()
def two_servers_on_redis(model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    pytest.importorskip("redis")
    with redis_server(tmp_path) as redis_url, two_servers(model_dir, redis_url) as urls:
        yield urls


@pytest.mark.redis
def test_two_server_processes_share_one_redis(two_servers_on_redis: tuple[str, str]) -> None:
    _check_sharing(*two_servers_on_redis)


# ---------------------------------------------------------------------------------------------- semantic index
# Distinct numbers in every question: the number guard refuses any donor, so each prompt is a miss that adds one
# entry to the shared index (and a later identical prompt is a hit on any server).
def _semantic_prompts(server: str) -> list[str]:
    return [f"Server {server}, question {i}: what is {i * 37 + 11} plus {i * 53 + 7}?" for i in range(10)]


def _check_semantic_index_keeps_every_entry(a: str, b: str, store_url: str) -> None:
    """Both servers add entries to the semantic index at the same time; afterwards every entry is in the store and
    each server finds every prompt of the other through the index (a trailing space: not the exact stored tokens, the
    same embedding), from the other server's records loaded before a search."""
    prompts = {a: _semantic_prompts("A"), b: _semantic_prompts("B")}
    jobs = [(url, p) for pair in zip(*[[(url, p) for p in ps] for url, ps in prompts.items()], strict=True)
            for url, p in pair]  # fmt: skip
    with ThreadPoolExecutor(8) as pool:  # 4 requests in flight on each server, the two servers interleaved
        firsts = list(pool.map(lambda job: _chat(*job), jobs))
    assert all(out["kvforge"]["reuse"] == "miss" for out in firsts), [o["kvforge"] for o in firsts]

    from kvforge.store import open_store

    store = open_store(store_url)
    records = [k for k in store.blob_keys() if k.startswith("semantic-v1-rec-")]
    assert len(records) == 20, sorted(records)  # one record per prompt, none lost
    for url, other in ((a, b), (b, a)):
        for prompt in prompts[other]:
            out = _chat(url, prompt + " ")
            assert out["kvforge"]["reuse"] == "semantic", (url, prompt, out["kvforge"])
            assert out["kvforge"]["similarity"] > 0.99 and out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_two_server_processes_add_to_one_semantic_index_on_a_file_store(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    url = f"file://{tmp_path / 'kv'}"
    with two_servers(model_dir, url, reuse="semantic") as (a, b):
        _check_semantic_index_keeps_every_entry(a, b, url)


@pytest.mark.redis
def test_two_server_processes_add_to_one_semantic_index_on_redis(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    pytest.importorskip("redis")
    with redis_server(tmp_path) as url, two_servers(model_dir, url, reuse="semantic") as (a, b):
        _check_semantic_index_keeps_every_entry(a, b, url)


# ---------------------------------------------------------------------------------------------- learned statistics
class _AlwaysWrong:
    """Wraps a strategy's sampling: every check runs through the server's engine as usual, and its outcome is reported
    as a disagreement (deterministic whatever the tiny model's continuations)."""

    def __init__(self, reuse: Any) -> None:
        self.calls, self.reuse = 0, reuse
        self.sample = reuse._sample
        reuse._sample = self

    def __call__(self, *args: Any) -> Any:
        check = self.sample(*args)
        if check is not None:
            report = check.report

            def wrong(agree: bool) -> None:
                report(False)
                self.calls += 1

            check.report = wrong
        return check


def _learning_app(store_url: str) -> tuple[LiveServer, Any]:
    from kvforge.reuse import FakeEmbedder
    from kvforge.reuse.policy import BoundedErrorPolicy, Prior

    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    app = create_app(engine, model_name=MODEL, store_url=store_url, reuse="semantic", embedder=FakeEmbedder(),
                     semantic={"max_error": 0.05, "verify_ratio": 1.0})  # fmt: skip
    reuse = engine.reuse
    reuse.stats.refresh_s = 0.0
    reuse.policy = BoundedErrorPolicy(0.05, prior=Prior("fake", {(1, "substitution", 600): 5000}), min_similarity=0.6)
    return LiveServer(app), _AlwaysWrong(reuse)


def _check_learning_is_shared(store_url: str) -> None:
    """Server A serves paraphrases and verifies them (found wrong); server B, on the same store, then refuses the
    same entries at that similarity; the statistics in the store hold every verification of both, none lost."""
    (a, reuse_a), (b, reuse_b) = _learning_app(store_url), _learning_app(store_url)
    try:
        prompts = [f"Tell me a fact about the planet number {i} of the solar system" for i in range(6)]
        for i, p in enumerate(prompts):  # stored through either server
            assert _chat((a if i % 2 else b).url, p)["kvforge"]["reuse"] == "miss"
        hits = [_chat(a.url, p + " please")["kvforge"] for p in prompts]  # served by A, then verified by A
        assert all(h["reuse"] == "semantic" for h in hits), hits
        deadline = time.monotonic() + 30  # verification runs after the answer
        while reuse_a.calls < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reuse_a.calls >= len(prompts)
        again = [_chat(b.url, p + " please")["kvforge"] for p in prompts]
        assert all(g["reuse"] == "miss" for g in again), again  # B learned from A's verifications
        deadline = time.monotonic() + 30
        while reuse_a.calls + reuse_b.calls < 2 * len(prompts) and time.monotonic() < deadline:
            time.sleep(0.05)
        from kvforge.reuse.stats import SharedStats
        from kvforge.store import open_store

        merged = SharedStats(open_store(store_url), reuse_a.reuse.stats.prefix, refresh_s=0).view()
        assert merged.num_observations == reuse_a.calls + reuse_b.calls
    finally:
        a.close()
        b.close()


def test_two_apps_learn_from_each_others_verifications_on_a_file_store(tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    _check_learning_is_shared(f"file://{tmp_path / 'kv'}")


@pytest.mark.redis
def test_two_apps_learn_from_each_others_verifications_on_redis(tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    pytest.importorskip("redis")
    with redis_server(tmp_path) as url:
        _check_learning_is_shared(url)
