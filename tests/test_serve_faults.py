"""``kvforge serve`` in a real process under faults the OS enforces: its disk store mounted read-only or filled while it
runs, its password-protected Redis stopped, SIGTERM. Stored prompts still hit, new ones answer uncached, documents
that cannot be stored are 503s, and nothing answers 500 or prints a traceback or a password."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from os_faults import full_disk, namespaces_or_skip, python_env, read_only  # noqa: E402
from store_helpers import redis_server  # noqa: E402

PROMPT = "".join(f"Room {i} keeps the code {i * 37 % 1000:03d}. " for i in range(12))  # ~310 tokens: one block
PASSWORD = "Qz#?/,@Xk9J"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served(model_dir: Path, store: str, wrap: Any = None, *extra: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """``kvforge serve`` (prefix reuse on ``store``) in a child process, optionally wrapped by an OS fault."""
    port = _free_port()
    argv = [sys.executable, "-m", "kvforge.cli", "serve", "--model", str(model_dir), "--served-model-name", "tiny",
            "--port", str(port), "--device", "cpu", "--reuse", "prefix", "--store", store, *extra]  # fmt: skip
    proc = subprocess.Popen(wrap(argv) if wrap else argv, env=python_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _complete(url: str, prompt: str = PROMPT) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3}, timeout=60)


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _documents(url: str, mode: str, text: str) -> httpx.Response:
    return httpx.post(url + "/v1/kv/documents", json={"documents": [text], "mode": mode}, timeout=60)


def _while_faulted(tmp_path: Path, tiny_llama_dir: Path, fault: Any) -> str:
    """Store a prompt, fault the store's folder, then ask again and ask new things; returns the server's output."""
    folder, trigger = tmp_path / "kv", tmp_path / "fault-now"
    folder.mkdir()
    with served(tiny_llama_dir, f"file://{folder}", lambda argv: fault(folder, argv, trigger=trigger)) as (url, proc):
        assert _cached(_complete(url)) == 0 and _cached(_complete(url)) > 0  # stored, then a hit
        assert _documents(url, "prefix", "A document stored before the fault.").status_code == 200
        trigger.touch()
        deadline = time.monotonic() + 30
        while not trigger.with_suffix(".done").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        answers = [_complete(url), _complete(url, PROMPT[::-1]), _complete(url, PROMPT[::-1])]
        assert _cached(answers[0]) > 0, "a stored prompt still hits"
        assert _cached(answers[1]) == 0 and _cached(answers[2]) == 0, "a new prompt answers, uncached"
        for mode, text in (("prefix", "A new document after the fault."), ("chunks", "A new chunk after the fault.")):
            r = _documents(url, mode, text)
            assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
        assert _documents(url, "prefix", "A document stored before the fault.").status_code == 200  # already there
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'code="500"' not in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        output = proc.communicate()[0]
    assert "Traceback" not in output, output
    return output


def test_server_on_a_store_mounted_read_only_while_it_runs(tmp_path: Path, tiny_llama_dir: Path) -> None:
    namespaces_or_skip()
    output = _while_faulted(tmp_path, tiny_llama_dir, read_only)
    assert sum("write of" in line and "[EROFS]" in line for line in output.splitlines()) == 1, output


def test_server_on_a_disk_that_fills_while_it_runs(tmp_path: Path, tiny_llama_dir: Path) -> None:
    namespaces_or_skip()
    output = _while_faulted(tmp_path, tiny_llama_dir, lambda f, argv, trigger: full_disk(f, argv, "8m", trigger))
    assert sum("write of" in line and "[ENOSPC]" in line for line in output.splitlines()) == 1, output


def test_server_whose_password_protected_redis_stops(tmp_path: Path, tiny_llama_dir: Path) -> None:
    with redis_server(tmp_path / "redis", password=PASSWORD) as bare:
        url = bare.replace("redis://", f"redis://:{quote(PASSWORD, safe='')}@")
        with served(tiny_llama_dir, url) as (base, proc):
            assert _cached(_complete(base)) == 0 and _cached(_complete(base)) > 0
            subprocess.run(["redis-cli", "-p", bare.split(":")[2].split("/")[0], "-a", PASSWORD, "shutdown", "nosave"],
                           capture_output=True, timeout=10)  # fmt: skip
            assert _cached(_complete(base)) == 0 and _cached(_complete(base, PROMPT[::-1])) == 0
            r = _documents(base, "prefix", "A document while Redis is down.")
            assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
            seen = [r.text, httpx.get(base + "/health").text, httpx.get(base + "/metrics").text]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
            seen.append(proc.communicate()[0])
    for text in seen:
        for secret in (PASSWORD, quote(PASSWORD, safe=""), PASSWORD[:4]):
            assert secret not in text
    assert "Traceback" not in seen[-1]


def test_sigterm_answers_new_connections_503_then_exits_0(tmp_path: Path, tiny_llama_dir: Path) -> None:
    with served(tiny_llama_dir, "memory://", None, "--grace-period", "3", "--max-running", "1") as (url, proc):
        running: list[httpx.Response] = []
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1900}  # past 3 s
        thread = threading.Thread(target=lambda: running.append(httpx.post(url + "/v1/chat/completions", json=body,
                                                                          timeout=60)))  # fmt: skip
        thread.start()
        deadline = time.monotonic() + 30
        while not httpx.get(url + "/health", timeout=5).json()["busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        after = [httpx.get(url + "/health", timeout=5), httpx.post(url + "/v1/chat/completions", json=body, timeout=5)]
        assert [a.status_code for a in after] == [503, 503]  # answered, not refused
        assert all(a.json()["error"]["code"] == "shutting_down" and a.headers["retry-after"] for a in after)
        started = time.monotonic()
        assert proc.wait(30) == 0  # not -SIGTERM
        assert time.monotonic() - started < 3 + 5  # the grace period, plus uvicorn's own shutdown
        thread.join(30)
        assert running and running[0].status_code in (200, 503)
        with pytest.raises(httpx.TransportError):  # gone now
            httpx.get(url + "/health", timeout=2)
        assert "Traceback" not in proc.communicate()[0]
