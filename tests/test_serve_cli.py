"""``kvforge serve`` as a subprocess on a saved tiny model, driven by the stock openai client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kvforge.cli import build_parser  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until_up(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def test_serve_parser_defaults_to_localhost() -> None:
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert (args.host, args.port, args.reuse, args.press) == ("127.0.0.1", 8000, "none", None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--compression-ratio", "1.0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reuse", "sideways"])


def test_kvforge_serve_subprocess(tiny_llama_dir: Path) -> None:
    folder = tiny_llama_dir
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [
        sys.executable,
        "-m",
        "kvforge.cli",
        "serve",
        "--model",
        str(folder),
        "--served-model-name",
        "tiny",
        "--port",
        str(port),
        "--api-key",
        "k",
        "--device",
        "cpu",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_until_up(proc, f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=30)
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
        )
        assert out.choices[0].finish_reason in ("length", "stop")
        assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens == len(out.choices[0].message.content)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bad", max_retries=0).models.list()
    finally:
        proc.terminate()
        proc.wait(15)


def test_sigterm_cancels_waiting_requests_and_exits(tiny_llama_dir: Path) -> None:
    """SIGTERM: no new work, waiting requests get a 503 at once, the running one gets the grace period, then exit."""
    import signal
    import threading

    port = _free_port()
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [
        sys.executable,
        "-m",
        "kvforge.cli",
        "serve",
        "--model",
        str(tiny_llama_dir),
        "--served-model-name",
        "tiny",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--grace-period",
        "1",
        "--max-running",
        "1",  # one in the batch, the others wait: SIGTERM must answer those 503
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(proc, url)
        answers: list[httpx.Response] = []
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1900}

        def ask() -> None:
            answers.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=120))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", timeout=5).json()["queue_depth"] < 2:
            assert time.monotonic() < deadline and all(t.is_alive() for t in threads), "no queue built up"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0  # the signal is handled (drain), not re-raised
        assert {a.status_code for a in answers} <= {200, 503} and len(answers) == 4
        refused = [a.json()["error"] for a in answers if a.status_code == 503]
        assert len(refused) >= 2 and all(e["code"] == "shutting_down" for e in refused)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(15)
