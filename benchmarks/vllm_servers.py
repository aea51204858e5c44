"""Servers and requests for the vLLM side-by-side scripts: start/stop vLLM (with or without kvforge's connector),
``kvforge serve`` and ``kvforge route`` as subprocesses, and time streamed chat requests (TTFT, cached tokens).

Not a pytest module: ``vllm_side_by_side.py`` and ``vllm_bars.py`` import it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from common import ROOT, Server, append_rows

TEXT = (ROOT / "src/kvforge/data/haystack_gutenberg/moby_dick_excerpt.txt").read_text()


def connector_config(store: str, **extra: Any) -> str:
    """The ``--kv-transfer-config`` JSON that loads kvforge's connector on ``store``."""
    return json.dumps({
        "kv_connector": "KVForgeConnector",
        "kv_connector_module_path": "kvforge.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": store, **extra},
    })  # fmt: skip


VLLM_ARGS: list[str] = []  # extra vLLM options for every server (e.g. --enforce-eager for a quick smoke run)
# extra environment for every vLLM server; e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=1: on CPU, vLLM reserves one more core
# for its scheduler when any KV connector is configured (meant for NIXL), which on a 2-core machine leaves none and
# makes the worker run two OpenMP threads against its own scheduler (see docs/vllm.md)
VLLM_ENV: dict[str, str] = {}


def vllm_server(name: str, port: int, model: str, log_dir: Path, store: str | None = None, **extra: Any) -> Server:
    """vLLM's OpenAI server on ``model`` in fp32, prompt-token details on, dev endpoints (``/reset_prefix_cache``)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
               "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port), *VLLM_ARGS]  # fmt: skip
    if store is not None:
        command += ["--kv-transfer-config", connector_config(store, **extra)]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    return Server(name, command, port, log_dir, env | VLLM_ENV)


# extra environment for kvforge serve; e.g. OMP_NUM_THREADS=1 to give it the one thread vLLM's CPU worker gets on a
# 2-core machine (vLLM keeps a core for its scheduler), instead of a 2-thread team fighting the other servers
KVFORGE_ENV: dict[str, str] = {}


def kvforge_server(name: str, port: int, model: str, store: str, log_dir: Path, *extra: str) -> Server:
    command = [sys.executable, "-m", "kvforge", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
               "--reuse", "prefix", "--store", store, *extra]  # fmt: skip
    return Server(name, command, port, log_dir, dict(KVFORGE_ENV))


def router(name: str, port: int, upstream: str, store: str, log_dir: Path) -> Server:
    command = [sys.executable, "-m", "kvforge", "route", "--upstream", upstream, "--store", store, "--host",
               "127.0.0.1", "--port", str(port)]  # fmt: skip
    return Server(name, command, port, log_dir)


@contextlib.contextmanager
def redis_process(port: int, workdir: Path) -> Iterator[str]:
    """A throw-away ``redis-server`` on 127.0.0.1 (no persistence); yields its URL."""
    import redis

    workdir.mkdir(parents=True, exist_ok=True)
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(workdir)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def served_model(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def ask(url: str, model: str, messages: list[dict[str, str]], max_tokens: int = 24, timeout_s: float = 900.0) -> dict:
    """One greedy streamed chat request: TTFT (first content token), text, usage (cached tokens), router report."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    ttft, pieces, usage = None, [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout_s) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{url} answered {answer.status_code}: {answer.read().decode()[:500]}")
        route = answer.headers.get("x-kvforge-route")
        for event in events(answer):
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    pieces.append(piece)
    details = usage.get("prompt_tokens_details") or {}
    latency = time.perf_counter() - start
    generated = usage.get("completion_tokens") or 0
    return {
        "ttft_s": ttft,
        "latency_s": latency,
        "completion_tokens": generated,
        "decode_s_per_token": (latency - ttft) / (generated - 1) if ttft is not None and generated > 1 else None,
        "text": "".join(pieces),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens", 0),
        "route": route,
    }


def events(answer: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed OpenAI answer (``[DONE]`` and other lines skipped)."""
    for line in answer.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def reset_prefix_cache(url: str) -> None:
    """Empty vLLM's in-memory prefix cache (not the store), so the next hit comes from the connector."""
    httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()


def document_prompt(tokenizer: Any, num_tokens: int, offset_words: int, question: str) -> list[dict[str, str]]:
    """A chat whose rendered prompt has ``num_tokens`` tokens: a Moby-Dick passage from ``offset_words``, then the
    question."""
    words = TEXT.split()[offset_words:]
    lo, hi = 1, len(words)
    while lo < hi:  # the longest passage that fits
        mid = (lo + hi + 1) // 2
        messages = [{"role": "user", "content": " ".join(words[:mid]) + "\n\n" + question}]
        size = chat_tokens(tokenizer, messages)
        lo, hi = (mid, hi) if size <= num_tokens else (lo, mid - 1)
    return [{"role": "user", "content": " ".join(words[:lo]) + "\n\n" + question}]


def chat_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of the prompt a server renders for ``messages`` (chat template, generation prompt)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


LOCK_STATE = {"exclusive_lock": None}  # written into every result line: whether the timing lock was held


@contextlib.contextmanager
def exclusive(lock_path: str | None, wait_s: float = 180.0) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``lock_path`` (if given) while timing, so other heavy jobs wait. On a shared
    machine where other jobs hold the lock for hours, it is given up after ``wait_s`` and the run goes on without it
    (every line says whether the lock was held; the ratios come from alternating requests either way)."""
    if lock_path is None:
        yield False
        return
    with open(lock_path, "a") as f:
        print(f"[bench] waiting up to {wait_s:.0f} s for the exclusive lock {lock_path}", file=sys.stderr)
        deadline = time.monotonic() + wait_s
        held = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    print("[bench] the lock is busy: timing without it", file=sys.stderr)
                    break
                time.sleep(1.0)
        LOCK_STATE["exclusive_lock"] = held
        try:
            yield held
        finally:
            LOCK_STATE["exclusive_lock"] = None
            if held:
                fcntl.flock(f, fcntl.LOCK_UN)


def write_line(path: Path, record: dict) -> None:
    record = record | {"load_avg_1m": round(os.getloadavg()[0], 2)}  # the machine may be shared: say how busy
    if LOCK_STATE["exclusive_lock"] is not None:
        record["exclusive_lock"] = LOCK_STATE["exclusive_lock"]
    append_rows(path, record)
    print(json.dumps(record), flush=True)
