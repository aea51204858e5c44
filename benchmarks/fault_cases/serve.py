"""Server cases: ``kvforge serve`` in a child process on the tiny model, driven over HTTP on 127.0.0.1. A case tied to
promises returns, beside what it saw, the statuses each promise got; the driver checks them against docs/serve.md."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from fault_cases import PROMPT, SEEN, Case, Server, cached, chat, complete, ends, equals, note, post, server, starts

DOC = "".join(f"Fact {i}: the code word of room {i} is {chr(97 + i % 26) * 3}. " for i in range(8))  # ~300 tokens
QUESTION = "What is the code word of room 3?"


def _statuses(responses: list[Any]) -> list[int]:
    return [r.status_code for r in responses]


# ------------------------------------------------------------------------------------------------ store faults
def _store_fault_run(srv: Server, fault_now: Any) -> tuple[str, dict[str, list[int]]]:
    """A prompt and a document stored, the fault applied, then: the stored prompt, new prompts, new documents."""
    first = [complete(srv, PROMPT), complete(srv, PROMPT)]
    before = cached(first[1])
    fault_now()
    generation = [complete(srv, PROMPT), complete(srv, PROMPT[::-1]), chat(srv, DOC[::-1])]
    documents = [post(srv, "/v1/kv/documents", {"documents": ["New. " + DOC]}),  # ~300 tokens: over 64 KiB
                 post(srv, "/v1/kv/documents", {"documents": ["Chunk. " + DOC], "mode": "chunks"})]  # fmt: skip
    rc = srv.stop()
    warned = sum("write of" in line for line in srv.output.splitlines())
    text = (f"hit before {before > 0}, stored prompt {'hits' if cached(generation[0]) > 0 else 'misses'}, new "
            f"{_statuses(generation[1:])}, documents {_statuses(documents)}, {warned} write warning, exit {rc}, "
            f"{srv.output.count('Traceback')} tracebacks")  # fmt: skip
    return text, {"store-fault-generation": _statuses(generation), "store-fault-documents": _statuses(documents)}


def _fault_when_touched(trigger: Path) -> Any:
    def apply() -> None:
        trigger.touch()
        deadline = time.monotonic() + 30
        while not trigger.with_suffix(".done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    return apply


_STORE_OK = "hit before True, stored prompt hits, new [200, 200], documents [503, 503], 1 write warning, exit 0, 0 tra"


def server_disk_fault(fault: str) -> Callable[[Path], tuple[str, dict[str, list[int]]]]:
    """A case: ``kvforge serve`` on a disk store that an OS fault hits while it runs (``os_faults.read_only``: the
    bind mount remounted read-only; ``full_disk``: an 8 MiB tmpfs filled)."""

    def run(tmp: Path) -> tuple[str, dict[str, list[int]]]:
        import os_faults

        folder, trigger = tmp / "kv", tmp / "fault-now"
        folder.mkdir()
        apply, size = getattr(os_faults, fault), ("8m",) if fault == "full_disk" else ()
        with server("--reuse", "prefix", store=f"file://{folder}",
                    wrap=lambda argv: apply(folder, argv, *size, trigger=trigger)) as srv:  # fmt: skip
            return _store_fault_run(srv, _fault_when_touched(trigger))

    return run


def server_file_size_limit(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    from os_faults import file_size_limit

    folder = tmp / "kv"
    with server("--reuse", "prefix", store=f"file://{folder}", preexec=file_size_limit(64 * 1024)) as srv:
        return _store_fault_run(srv, lambda: None)


def server_redis_stops(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    import subprocess

    from store_helpers import redis_server

    pw = "Qz#?/,@Xk9J"
    with redis_server(tmp / "redis", password=pw) as bare:
        port = bare.split(":")[2].split("/")[0]
        url = bare.replace("redis://", f"redis://:{quote(pw, safe='')}@")
        with server("--reuse", "prefix", store=url) as srv:

            def stop_redis() -> None:
                subprocess.run(["redis-cli", "-p", port, "-a", pw, "shutdown", "nosave"], capture_output=True,
                               timeout=10)  # fmt: skip

            first = [complete(srv, PROMPT), complete(srv, PROMPT)]
            stop_redis()
            generation = [complete(srv, PROMPT), complete(srv, PROMPT[::-1])]
            documents = [post(srv, "/v1/kv/documents", {"documents": ["A new document."]}),
                         post(srv, "/v1/kv/documents", {"documents": ["A new chunk."], "mode": "chunks"})]  # fmt: skip
            bodies = [r.text for r in first + generation + documents]
            bodies += [note(httpx.get(srv.url + "/health")).text, note(httpx.get(srv.url + "/metrics")).text]
            rc = srv.stop()
    shown = sum(text.count(form) for text in [*bodies, srv.output] for form in (pw[:5], quote(pw, safe="")[:8]))
    text = (f"hit before {cached(first[1]) > 0}, prompts {_statuses(generation)} cached "
            f"{[cached(r) for r in generation]}, documents {_statuses(documents)}, exit {rc}, password shown {shown} "
            "times")  # fmt: skip
    return text, {"store-fault-generation": _statuses(generation), "store-fault-documents": _statuses(documents)}


def server_store_down_at_start(tmp: Path) -> str:
    import subprocess
    import sys

    from os_faults import python_env

    from fault_cases import free_port, tiny_model_dir

    argv = [sys.executable, "-m", "kvforge.cli", "serve", "--model", str(tiny_model_dir()), "--port",
            str(free_port()), "--store", f"redis://:Qz%23pw@127.0.0.1:{free_port()}/0"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=python_env(), timeout=120)
    took = time.monotonic() - start
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], env=python_env(), timeout=300, check=True)
    peer = time.monotonic() - start
    traceback = "traceback" if "Traceback" in proc.stderr else "no traceback"
    return (f"exit {proc.returncode}, {proc.stderr.count(chr(10))} line, {traceback}, "
            f"{'faster' if took < peer else 'SLOWER'} than import torch: {took:.1f} s vs {peer:.1f} s")  # fmt: skip


# ------------------------------------------------------------------------------------------------ inputs
_ODD_BODIES: list[tuple[str, Any]] = [
    ("bad-body", b"{not json"),
    ("bad-body", {"model": "tiny", "messages": "hi"}),
    ("bad-body", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 2}}),
    ("bad-body", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "kvforge": {"reuse": "exact"}}),
    ("bad-body", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "kvforge": {"pres": "snapkv"}}),
    ("bad-body", [1, 2, 3]),
    ("odd-values", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 2**63}),
    ("odd-values", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": -1}),
    ("odd-values", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.5}),
    ("odd-values", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": True}),
    ("odd-values", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**40}),
    ("odd-values", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}),
    ("odd-values", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "kvforge": {"press": "x" * 999}}),
    ("unknown-name", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "kvforge": {"press": "snapk"}}),
    ("unknown-model", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}),
    ("context-length", {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 800}], "max_tokens": 8}),
]
_ODD_PROMPTS: list[tuple[str, Any]] = [("bad-token-id", [-1, 5]), ("bad-token-id", [5, 10**6]), ("bad-body", [])]
_NAN = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'


def odd_inputs(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    got: dict[str, list[int]] = {}
    lines = 0
    with server() as srv:
        for promise, body in [*_ODD_BODIES, ("odd-values", _NAN.encode())]:
            if isinstance(body, bytes):
                r = note(httpx.post(srv.url + "/v1/chat/completions", content=body, timeout=30,
                                    headers={"content-type": "application/json"}))  # fmt: skip
            else:
                r = post(srv, "/v1/chat/completions", body)
            got.setdefault(promise, []).append(r.status_code)
            lines += "\n" in r.json()["error"]["message"]
        for promise, prompt in _ODD_PROMPTS:
            r = post(srv, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
            got.setdefault(promise, []).append(r.status_code)
            lines += "\n" in r.json()["error"]["message"]
    summary = ", ".join(f"{k} {v}" for k, v in got.items())
    return f"{summary}; {'all one line' if not lines else f'{lines} multi-line'}", got


def chunk_ids(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    bad = ["../../etc/passwd", "", "a\x00b", "*", "x" * 10_000]
    with server() as srv:
        answers = [chat(srv, "Where?", kvforge={"rag": "naive", "chunk_ids": [cid]}) for cid in bad]
        unknown = chat(srv, "Where?", kvforge={"rag": "naive", "chunk_ids": ["f" * 64]})
    multi = sum("\n" in r.json()["error"]["message"] for r in [*answers, unknown] if r.status_code >= 400)
    params = {r.json()["error"]["param"] for r in answers if r.status_code >= 400}
    text = (
        f"{_statuses(answers)} {sorted(params)}, unknown {unknown.status_code}; {'one line' if not multi else 'multi'}"
    )
    return text, {"bad-chunk-id": _statuses(answers), "unknown-chunk-id": [unknown.status_code]}


def tiny_temperatures(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    with server() as srv:
        tiny = [chat(srv, "Where is the key?", max_tokens=8, temperature=t, seed=1) for t in (1e-38, 1e-45, 1e-320)]
        fine = [chat(srv, "Where is the key?", max_tokens=8, temperature=t, seed=1) for t in (0, 1e-5)]
    said = all(r.status_code == 400 and r.json()["error"]["param"] == "temperature" and "\n" not in
               r.json()["error"]["message"] and "0 (greedy) or at least 1e-05" in r.json()["error"]["message"]
               for r in tiny)  # fmt: skip
    return (f"{_statuses(tiny)} one line, the rule named: {said}; 0 and 1e-5: {_statuses(fine)}",
            {"tiny-temperature": _statuses(tiny)})  # fmt: skip


def api_key(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    from kvforge.cli import build_parser

    with server("--api-key", "k3y") as srv:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        refused = [post(srv, "/v1/chat/completions", body),
                   post(srv, "/v1/chat/completions", body, headers={"Authorization": "Bearer nope"})]  # fmt: skip
        allowed = post(srv, "/v1/chat/completions", body, headers={"Authorization": "Bearer k3y"})
        health = note(httpx.get(srv.url + "/health"))
    host = build_parser().parse_args(["serve"]).host
    text = f"{_statuses(refused)} {allowed.status_code} {health.status_code}; listens on {host}"
    return text, {"api-key": _statuses(refused)}


def body_too_large(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    with server("--max-body-bytes", "4096") as srv:
        big = json.dumps({"model": "tiny", "prompt": "x" * 8000}).encode()
        sized = note(httpx.post(srv.url + "/v1/completions", content=big, timeout=30))
        chunked = note(httpx.post(srv.url + "/v1/completions", content=iter([big[:3000], big[3000:]]), timeout=30))
    return str(_statuses([sized, chunked])), {"body-too-large": _statuses([sized, chunked])}


def overload(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    with server("--max-running", "1", "--max-queue", "2", "--timeout", "1") as srv:
        out: list[int] = []
        lock = threading.Lock()

        def ask() -> None:
            r = chat(srv, "Tell me everything.", max_tokens=1900, ignore_eos=True)  # outlasts --timeout 1
            with lock:
                out.append(r.status_code)

        threads = [threading.Thread(target=ask) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    counts = {s: out.count(s) for s in sorted(set(out))}
    ok = counts.get(429, 0) > 0 and counts.get(504, 0) > 0 and set(counts) <= {200, 429, 504}
    return f"{'ok' if ok else 'NOT'} {counts}", {"queue-full": [s for s in out if s == 429] or [0],
                                                 "timeout": [s for s in out if s == 504] or [0]}  # fmt: skip


def sigterm(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    with server("--grace-period", "3", "--max-running", "1") as srv:
        answers: dict[int, Any] = {}

        def ask(i: int) -> None:  # the running one lasts past the grace period (no early end on </s>)
            answers[i] = chat(srv, "hello", max_tokens=1900, ignore_eos=True)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while httpx.get(srv.url + "/health", timeout=5).json()["queue_depth"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        health = httpx.get(srv.url + "/health", timeout=5)
        while health.status_code == 200 and time.monotonic() < start + 3:  # until the signal is handled
            time.sleep(0.02)
            health = httpx.get(srv.url + "/health", timeout=5)
        new = [note(health), chat(srv, "hi after SIGTERM")]
        rc = srv.proc.wait(30)
        exit_s = time.monotonic() - start
        for t in threads:
            t.join(30)
        srv.stop()
    statuses = sorted(a.status_code for a in answers.values())
    queued = [s for s in statuses if s == 503][:3]
    text = f"queued {queued}, new {_statuses(new)}, exit {rc} after {exit_s:.1f} s (grace 3 s), all {statuses}"
    return text, {"shutting-down": [*queued, *_statuses(new)]}


def streaming_disconnects(tmp: Path) -> str:
    results: list[str | None] = []
    lock = threading.Lock()
    with server("--max-running", "32", "--max-queue", "64") as srv:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Count the rooms."}], "max_tokens": 64,
                "temperature": 0, "stream": True}  # fmt: skip

        def client(leave: bool) -> None:
            text, done, status = "", False, 0
            try:
                with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
                    status = r.status_code
                    for line in r.iter_lines():
                        if leave:
                            return
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            for choice in json.loads(line[6:]).get("choices", []):
                                text += choice.get("delta", {}).get("content") or ""
            except httpx.HTTPError as e:
                text = f"{type(e).__name__}"
            with lock:
                results.append(text if done else f"incomplete ({status}: {text[:40]})")

        threads = [threading.Thread(target=client, args=(i % 2 == 0,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        after = chat(srv, "still there?")
    complete_ = [r for r in results if not r.startswith("incomplete")]
    failed = sorted({r for r in results if r.startswith("incomplete")})
    return (f"{len(complete_)}/16 complete, {len(set(complete_))} distinct answer(s), then {after.status_code}"
            + (f"; {failed}" if failed else ""))  # fmt: skip


@contextlib.contextmanager
def _health_probe(srv: Server) -> Iterator[list[float]]:
    """The worst /health latency while the block runs (probed every 50 ms)."""
    worst, stop = [0.0], threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t = time.monotonic()
            httpx.get(srv.url + "/health", timeout=60)
            worst[0] = max(worst[0], time.monotonic() - t)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        yield worst
    finally:
        stop.set()
        prober.join(60)


def big_document(tmp: Path) -> str:
    with server("--max-body-bytes", str(16 * 2**20)) as srv, _health_probe(srv) as worst:
        doc: dict[str, Any] = {}
        sender = threading.Thread(target=lambda: doc.setdefault(
            "r", post(srv, "/v1/kv/documents", {"documents": ["word " * (7 * 2**20 // 5)]}, timeout=300)))  # fmt: skip
        sender.start()
        time.sleep(0.5)
        t = time.monotonic()
        answer = chat(srv, "A short question?")
        chat_s = time.monotonic() - t
        sender.join(300)
    ok = worst[0] < 1.0 and chat_s < 5.0 and answer.status_code == 200 and doc["r"].status_code == 400
    return (f"{'ok' if ok else 'NOT'}: /health worst {worst[0]:.2f} s, chat {answer.status_code} in {chat_s:.2f} s, "
            f"document {doc['r'].status_code}")  # fmt: skip


_BIG = 7 * 2**20


def _big_bodies() -> list[tuple[str, str, bytes]]:
    """(name, path, body) of ~7 MiB bodies whose prompt is far longer than the context: a million token ids (varied,
    as real ones are) and a chat of 200k messages. Encoded once, before anything is timed."""
    ids = [i * 7919 % 32000 for i in range(_BIG // 7)]  # "12345, " per id
    messages = [{"role": "user", "content": "x"}] * (_BIG // 34)
    return [("token ids", "/v1/completions", json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 1}).encode()),
            ("chat", "/v1/chat/completions", json.dumps({"model": "tiny", "messages": messages}).encode())]  # fmt: skip


def big_token_body(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    bodies, results = _big_bodies(), []
    with server("--max-body-bytes", str(16 * 2**20)) as srv, _health_probe(srv) as worst:
        for name, path, raw in bodies:
            t = time.monotonic()
            r = note(httpx.post(srv.url + path, content=raw, headers={"content-type": "application/json"},
                                timeout=120))  # fmt: skip
            results.append((name, r.status_code, time.monotonic() - t))
    parts, ok = [], worst[0] < 0.25
    for (name, status, took), (_, _, raw) in zip(results, bodies, strict=True):
        t = time.monotonic()
        json.loads(raw)  # the peer, after the server has stopped: nothing else runs
        peer = time.monotonic() - t
        ok = ok and status == 400 and took <= 2 * peer
        parts.append(f"{name} {status} in {took:.2f} s = {took / peer:.1f}x json.loads ({peer:.2f} s)")
    return (f"{'ok' if ok else 'NOT'}: {', '.join(parts)}; /health worst {worst[0]:.2f} s",
            {"context-length": [status for _, status, _ in results]})  # fmt: skip


def _ask_compressed(srv: Server, ratio: float) -> Any:
    return post(srv, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": DOC + "\n\n" + QUESTION}], "max_tokens": 4,
        "temperature": 0, "kvforge": {"reuse": "prefix", "press": "knorm", "compression_ratio": ratio,
                                      "query_aware": False}})  # fmt: skip


def compressed_across_servers(tmp: Path) -> str:
    store = f"file://{tmp / 'kv'}"
    with server("--reuse", "prefix", store=store) as a, server("--reuse", "prefix", store=store) as b:
        stored = post(a, "/v1/kv/documents", {"documents": [DOC], "press": "knorm", "compression_ratio": 0.5})
        hit = _ask_compressed(b, 0.5)
        other = _ask_compressed(b, 0.25)
    is_hit = cached(hit) > 0 and hit.json()["kvforge"]["compressed"]
    is_miss = cached(other) == 0 and not other.json()["kvforge"]["compressed"]
    return f"stored {stored.status_code}; other server: compressed hit {is_hit}; ratio 0.25: miss {is_miss}"


# ------------------------------------------------------------------------------------------------ over all cases
def no_500(tmp: Path) -> str:
    n = len(SEEN["statuses"])
    return (f"{SEEN['statuses'].count(500)} x 500, {SEEN['tracebacks']} tracebacks ({n} answers from "
            f"{SEEN['servers']} server processes)")  # fmt: skip


CASES = [
    Case("server: its disk store mounted read-only while it runs (bind mount remounted ro)",
         "stored prompt hits, new prompts 200 uncached, documents 503, 1 warning, exit 0, no traceback",
         server_disk_fault("read_only"), starts(_STORE_OK), promise="store-fault-generation,store-fault-documents",
         needs="namespaces"),
    Case("server: its disk (a tmpfs) filled while it runs",
         "stored prompt hits, new prompts 200 uncached, documents 503, 1 warning, exit 0, no traceback",
         server_disk_fault("full_disk"), starts(_STORE_OK), promise="store-fault-generation,store-fault-documents",
         needs="namespaces"),
    Case("server under ulimit -f 64 KiB (every entry is larger: EFBIG)",
         "prompts 200 uncached, documents 503, 1 warning, exit 0, no traceback", server_file_size_limit,
         lambda o: "new [200, 200], documents [503, 503], 1 write warning, exit 0, 0 tracebacks" in o,
         promise="store-fault-generation,store-fault-documents"),
    Case("server: its password-protected Redis shut down while it runs",
         "prompts 200 uncached, documents 503, exit 0, the password in no body, /health, /metrics or log line",
         server_redis_stops, lambda o: "documents [503, 503]" in o and o.endswith("password shown 0 times"),
         promise="store-fault-generation,store-fault-documents,no-secret", needs="redis-server"),
    Case("`kvforge serve --store` naming a Redis that is down",
         "refuses to start: exit 2, one line, before the model loads (faster than `import torch` alone, timed in "
         "the same run: a machine's load makes absolute times say little)", server_store_down_at_start,
         starts("exit 2, 1 line, no traceback, faster"), promise="store-down-at-start"),
    Case("odd inputs: bad JSON, wrong types, unknown fields and kvforge keys, seed 2**63 / -1, float/bool/2**40 "
         "max_tokens, NaN temperature, top_p 0, a 999-character press, unknown press and model, too long, token "
         "ids -1 / 10**6", "each the status of its promise, one-line message", odd_inputs, ends("all one line"),
         promise="bad-body,odd-values,unknown-name,unknown-model,context-length,bad-token-id"),
    Case("chat with kvforge.rag and chunk_ids ../../etc/passwd, '', NUL, *, 10k characters; a well-formed unknown id",
         "400 each with one line (param kvforge.chunk_ids), no file read", chunk_ids, ends("one line"),
         promise="bad-chunk-id,unknown-chunk-id"),
    Case("temperature 1e-38, 1e-45, 1e-320 (and 0, 1e-5)",
         "400 each, one line naming the rule (0 or at least 1e-5); 0 and 1e-5 answered", tiny_temperatures,
         equals("[400, 400, 400] one line, the rule named: True; 0 and 1e-5: [200, 200]"), promise="tiny-temperature"),
    Case("--api-key: no key, a wrong key, the key; /health open; the default bind address",
         "401, 401, 200, 200; 127.0.0.1", api_key, equals("[401, 401] 200 200; listens on 127.0.0.1"),
         promise="api-key"),
    Case("a body over --max-body-bytes (Content-Length and chunked)", "413 each", body_too_large, equals("[413, 413]"),
         promise="body-too-large"),
    Case("12 long requests at once on --max-running 1 --max-queue 2 --timeout 1",
         "some 429 (queue full), some 504 (timeout), the rest 200; nothing else", overload, starts("ok"),
         promise="queue-full,timeout"),
    Case("SIGTERM with a running request and 3 queued; then a new connection",
         "queued 503 at once, new connection 503 (not refused), exit 0 within the grace period", sigterm,
         starts("queued [503, 503, 503], new [503, 503], exit 0"), promise="shutting-down"),
    Case("32 streaming clients on one prompt, 16 disconnecting after their first token",
         "the 16 others get the same complete answer; the server keeps serving", streaming_disconnects,
         starts("16/16 complete, 1 distinct answer")),
    Case("a 7 MiB document to /v1/kv/documents while a chat is asked and /health probed every 50 ms",
         "/health worst < 1 s, the chat answered < 5 s, the document refused (400, too long)", big_document,
         starts("ok")),
    Case("a 7 MiB token-id body to /v1/completions, and a 7 MiB chat of 200k messages, while /health is probed "
         "every 50 ms",
         "each refused (400, longer than the context) in <= 2x the time json.loads takes to read the same bytes "
         "here (the unavoidable cost, measured in the same run), /health worst < 0.25 s", big_token_body, starts("ok"),
         promise="context-length"),
    Case("a compressed document (knorm 0.5) stored by one server, asked on another sharing the file store; then "
         "at 0.25", "the second server hits the compressed document; another ratio is a miss",
         compressed_across_servers, equals("stored 200; other server: compressed hit True; ratio 0.25: miss True")),
    Case("every server case above: answers with status 500, tracebacks in the servers' logs", "0 and 0", no_500,
         starts("0 x 500, 0 tracebacks"), promise="no-500"),
]
