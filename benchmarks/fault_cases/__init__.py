"""The fault benchmark's cases and what they share: the registry, ``kvforge serve`` in a child process, OS faults, and
the server's promises as written in docs/serve.md.

Each case module ends with its table, ``CASES``: one :class:`Case` a row, whose ``run(tmp) -> str | tuple[str, dict]``
returns what it observed and, for a case tied to promises, the HTTP statuses each promise got (each must be the
status docs/serve.md promises); ``ok`` (``equals``, ``starts``, ``ends`` or a function) says whether it held.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' helpers: tiny segments, redis-server, OS faults
from os_faults import python_env  # noqa: E402
from store_helpers import free_port  # noqa: E402

DOCS = ROOT / "docs" / "serve.md"


@dataclass
class Case:
    name: str
    expected: str
    run: Callable[[Path], Any]
    ok: Callable[[str], bool] | None = None
    promise: str | None = None  # the row of docs/serve.md's promise table whose status every answer must have
    needs: str | None = None  # "redis-server", "namespaces" or "fakeredis": skipped (with the reason) where missing


def equals(text: str) -> Callable[[str], bool]:
    return lambda observed: observed == text


def starts(text: str) -> Callable[[str], bool]:
    return lambda observed: observed.startswith(text)


def ends(text: str) -> Callable[[str], bool]:
    return lambda observed: observed.endswith(text)


def promises(path: Path = DOCS) -> dict[str, str]:
    """``{promise id: status}`` from the table under "What the server promises" in docs/serve.md
    (``| `id` | when | status | code |``)."""
    text = path.read_text(encoding="utf-8")
    section = text.split("### What the server promises", 1)[1].split("\n#", 1)[0]
    out = {}
    for line in section.splitlines():
        m = re.match(r"^\|\s*`([a-z0-9-]+)`\s*\|[^|]*\|\s*([^|]*?)\s*\|", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def promised_status(status: str) -> int | None:
    """The HTTP status a promise states (``503 + `Retry-After``` -> 503), None for ``never``."""
    m = re.match(r"(\d{3})", status)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------------------------ shared observations
SEEN = {"statuses": [], "tracebacks": 0, "servers": 0}  # every answer of every server case, and their logs


def note(response: Any) -> Any:
    SEEN["statuses"].append(response.status_code)
    return response


@contextlib.contextmanager
def warnings_logged() -> Iterator[list[str]]:
    """The messages of the warnings kvforge logs inside the block (whatever the logging configuration)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    kv_logger = logging.getLogger("kvforge")
    level = kv_logger.level
    kv_logger.addHandler(handler)
    kv_logger.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        kv_logger.removeHandler(handler)
        kv_logger.setLevel(level)


# ------------------------------------------------------------------------------------------------ the server
_MODEL_DIR: list[Path] = []


def tiny_model_dir() -> Path:
    """A tiny random Llama and the character tokenizer saved once per run (what the tests serve)."""
    if not _MODEL_DIR:
        from kvforge.testing import tiny_model, tiny_tokenizer

        path = Path(tempfile.mkdtemp(prefix="kvforge-faults-model-"))
        tiny_model("llama").save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
        _MODEL_DIR.append(path)
    return _MODEL_DIR[0]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    output: str = ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int | None:
        """Signal the server, wait for it, keep its output; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = None
        self.output = self.proc.communicate()[0] or ""
        SEEN["tracebacks"] += self.output.count("Traceback")
        return rc


@contextlib.contextmanager
def server(*args: str, store: str = "memory://", wrap: Callable[[list[str]], list[str]] | None = None,
           preexec: Any = None) -> Iterator[Server]:  # fmt: skip
    """``kvforge serve`` on the tiny model (served as ``tiny``) in a child process; stopped with SIGTERM at the end."""
    import httpx

    port = free_port()
    argv = [sys.executable, "-m", "kvforge.cli", "serve", "--model", str(tiny_model_dir()), "--served-model-name",
            "tiny", "--port", str(port), "--device", "cpu", "--store", store, *args]  # fmt: skip
    proc = subprocess.Popen(wrap(argv) if wrap else argv, env=python_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=preexec)  # fmt: skip
    srv = Server(f"http://127.0.0.1:{port}", proc)
    SEEN["servers"] += 1
    try:
        deadline = time.monotonic() + 300  # importing torch takes minutes on 2 busy cores
        while True:
            try:
                if httpx.get(srv.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                rc = srv.stop()
                why = "exited" if time.monotonic() <= deadline else "timed out"
                raise RuntimeError(f"the server did not start ({why}, rc {rc}): {srv.output[-500:]}")
            time.sleep(0.2)
        yield srv
    finally:
        if proc.poll() is None:
            srv.stop()
        elif proc.stdout is not None and not proc.stdout.closed:  # exited by itself: keep what it printed
            srv.output = proc.communicate()[0] or ""


def post(srv: Server, path: str, body: Any, timeout: float = 60, **kwargs: Any) -> Any:
    import httpx

    return note(httpx.post(srv.url + path, json=body, timeout=timeout, **kwargs))


def complete(srv: Server, prompt: str, max_tokens: int = 3, **extra: Any) -> Any:
    return post(srv, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens} | extra)


def chat(srv: Server, content: str, max_tokens: int = 4, **extra: Any) -> Any:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return post(srv, "/v1/chat/completions", body | extra)


def cached(response: Any) -> int:
    if response.status_code != 200:
        return -1
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


PROMPT = "".join(f"Room {i} keeps the code {i * 37 % 1000:03d}. " for i in range(12))  # ~310 tokens: one block
