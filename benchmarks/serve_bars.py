"""The server's latency bars, each measured in one run alternating the two sides (one JSON line per measurement).

- ``ttft``: a lone cold prompt (``--tokens`` ids, a new one each time) streamed by ``kvforge serve`` (the default
  batched scheduler) to its first token, against a lone ``Engine`` prefill of the same ids in this process.
- ``versus``: ``kvforge serve`` against vLLM's OpenAI server (its CPU build, from ``--vllm-python``) on the same
  weights and ``--threads``: a cold ``--tokens`` chat prompt, the same prompt again (a prefix hit) and its decode
  seconds per token, ``--requests`` short chats one after another, and the same chats at once; while one side is
  timed the other is stopped (SIGSTOP: an idle vLLM CPU server keeps polling and takes a core).
- ``document``: ``--questions`` questions on one document stored compressed (query-agnostic press, through
  ``POST /v1/kv/documents``), sent all at once against one after another; the greedy answers are compared with
  ``Engine`` alone. ``engine-document``: the same loop in this process, ``Engine.run_many`` against ``Engine.run``.

    PYTHONPATH=src python benchmarks/serve_bars.py ttft --tokens 2048 --repeats 3
    PYTHONPATH=src python benchmarks/serve_bars.py ttft-inprocess --tokens 2048 --repeats 2
    PYTHONPATH=src python benchmarks/serve_bars.py versus --vllm-python VENV/bin/python --threads 1 --rounds 3
    PYTHONPATH=src python benchmarks/serve_bars.py document --questions 8 --rounds 2
    PYTHONPATH=src python benchmarks/serve_bars.py engine-document --doc-tokens 600 --max-tokens 12 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from common import RESULTS, ROOT, Server, cpu_seconds

PIDS: dict[str, int] = {}  # server url -> its process id (CPU seconds from /proc)
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
             "What is 12 times 12?", "Who wrote Hamlet?", "What is the boiling point of water?",
             "Name a planet with rings.", "What language is spoken in Brazil?"]  # fmt: skip


@contextmanager
def server(command: list[str], port: int, log: Path, ready: str = "/v1/models", timeout_s: float = 900.0,
           env: dict[str, str] | None = None) -> Iterator[str]:  # fmt: skip
    """Start ``command`` (a server on ``port``, its output appended to ``log``, ``env`` added to this process's),
    wait until ``ready`` answers, stop it (SIGTERM, then SIGKILL)."""
    with Server(log.name.removesuffix(".log"), command, port, log.parent, dict(env or {})).start() as srv:
        srv.wait(timeout_s, ready)
        PIDS[srv.url] = srv.process.pid  # type: ignore[union-attr]
        yield srv.url


@contextmanager
def others_paused(urls: list[str]) -> Iterator[None]:
    """Freeze the servers at ``urls`` (SIGSTOP to their process groups) while the side being timed runs.

    An idle vLLM CPU server keeps polling its workers' message queue, which takes a core from whatever runs beside
    it on a small machine; each side is timed with the others stopped, so neither pays for the other's idling.
    """
    groups = [os.getpgid(PIDS[u]) for u in urls]
    for g in groups:
        os.killpg(g, signal.SIGSTOP)
    try:
        yield
    finally:
        for g in groups:
            os.killpg(g, signal.SIGCONT)
        time.sleep(0.5)


def kvforge_command(args: argparse.Namespace, port: int, *extra: str) -> list[str]:
    # a long request timeout: on a loaded machine the server's shedding (a deadline it expects to miss) would refuse
    # the concurrent rounds, and the bars time the work, not the admission
    return [sys.executable, "-m", "kvforge", "serve", "--model", args.model, "--port", str(port),
            "--served-model-name", "m", "--timeout", "3600", *extra]  # fmt: skip


def stream(url: str, path: str, body: dict[str, Any]) -> tuple[float, float, str, int]:
    """(seconds to the first generated text, seconds to the end, text, number of streamed pieces that carried text:
    one per token on both servers) of a streamed request."""
    start, first, text = time.perf_counter(), None, []
    with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=900.0) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if piece and first is None:
                first = time.perf_counter() - start
            text.append(piece)
    end = time.perf_counter() - start
    return (first if first is not None else end), end, "".join(text), sum(1 for t in text if t)


def model_thread(url: str) -> dict[str, float]:
    """The server's model-thread counters from ``/metrics``: steps, decode rows, prompt tokens, seconds per phase."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=60.0).text.splitlines():
        if line.startswith("kvforge_model_thread_"):
            name, _, value = line.rpartition(" ")
            name = name.removeprefix("kvforge_model_thread_").replace('seconds_total{phase="', "s_").rstrip('"}')
            out[name.removesuffix("_total")] = float(value)
    return out


def chat(url: str, model: str, content: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=900.0)
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def haystack_ids(tokenizer: Any, num_tokens: int, offset: int) -> list[int]:
    text = (ROOT / "src/kvforge/data/haystack_gutenberg/moby_dick_excerpt.txt").read_text()
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    start = offset * 97 % len(ids)  # another start per offset: a cold prompt each time
    return (ids * (num_tokens // len(ids) + 2))[start : start + num_tokens]


# ---------------------------------------------------------------------------------------------------- bars
def bench_ttft(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Lone cold prompt: server TTFT (streamed, client side) vs the Engine's prefill + first token, alternating."""
    import torch

    from kvforge.engine import Engine
    from kvforge.model import load_model

    model, tokenizer = load_model(args.model)
    engine = Engine(model, tokenizer)
    engine.prefill(haystack_ids(tokenizer, 64, 998))  # warm up, as the server is below
    with server(kvforge_command(args, args.port, *args.kvforge_args), args.port, args.log) as url:
        stream(url, "/v1/completions", {"model": "m", "prompt": haystack_ids(tokenizer, 64, 999), "max_tokens": 2})
        for i in range(args.repeats):
            measured: dict[str, tuple[float, float]] = {}  # side -> (wall s, CPU s)
            for side in ("server", "engine") if i % 2 == 0 else ("engine", "server"):
                ids = haystack_ids(tokenizer, args.tokens, 2 * i + (side == "engine"))
                if side == "server":
                    cpu = cpu_seconds(PIDS[url])
                    served, _, _, _ = stream(url, "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 1})
                    measured[side] = served, cpu_seconds(PIDS[url]) - cpu
                else:  # what the server's first token costs at least: the prefill, then argmax
                    cpu, start = time.process_time(), time.perf_counter()
                    _, logits = engine.prefill(ids)
                    int(logits.argmax(-1))
                    measured[side] = time.perf_counter() - start, time.process_time() - cpu
            (served, served_cpu), (alone, alone_cpu) = measured["server"], measured["engine"]
            yield {"bar": "ttft", "tokens": args.tokens, "repeat": i, "first": "server" if i % 2 == 0 else "engine",
                   "server_ttft_s": round(served, 4), "engine_ttft_s": round(alone, 4),
                   "ratio": round(served / alone, 4), "server_cpu_s": round(served_cpu, 3),
                   "engine_cpu_s": round(alone_cpu, 3), "cpu_ratio": round(served_cpu / alone_cpu, 4),
                   "threads": torch.get_num_threads(), "kvforge_args": args.kvforge_args}  # fmt: skip


def vllm_available(python: str) -> str | None:
    """None when ``python`` imports vLLM, else why not (one line)."""
    try:
        done = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python}: {e}"
    return None if done.returncode == 0 else f"{python} cannot import vllm: {done.stderr.strip().splitlines()[-1:]}"


def bench_versus(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """kvforge serve against vLLM's OpenAI server (same fp32 weights), each timed with the other stopped, alternating
    which goes first: a cold ``--tokens`` chat prompt (TTFT), the same prompt again (TTFT of a prefix hit) and its
    decode seconds per token, ``--requests`` short chats one after another, and the same chats all at once.
    ``--threads``: the compute threads of each side (kvforge: ``OMP_NUM_THREADS``; vLLM: its worker's OpenMP team,
    ``VLLM_CPU_OMP_THREADS_BIND``)."""
    from contextlib import ExitStack

    from transformers import AutoTokenizer

    from kvforge.model import model_folder

    folder = str(model_folder(args.model))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    threads = args.threads or 1
    why_not = vllm_available(args.vllm_python)
    if why_not:
        raise SystemExit(f"versus needs vLLM: {why_not}")
    vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--dtype", "float32",
            "--enable-prompt-tokens-details", "--enable-prefix-caching", "--host", "127.0.0.1", "--port",
            str(args.port + 1), "--served-model-name", "m"]  # fmt: skip
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip
    kv_env = {"OMP_NUM_THREADS": str(threads)}
    kv_cmd = kvforge_command(args, args.port, "--reuse", "prefix", "--store", "memory://", *args.kvforge_args)
    question = "\n\nIn one sentence, what is this passage about?"
    hf = _Generate(folder, threads)
    with ExitStack() as stack:
        urls = {"kvforge": stack.enter_context(server(kv_cmd, args.port, args.log, env=kv_env)),
                "vllm": stack.enter_context(server(vllm, args.port + 1, args.log, timeout_s=1200.0, env=vllm_env))}
        for url in urls.values():
            chat(url, "m", "Hello!", 4)  # warm up
        for round_ in range(args.rounds):
            measured: dict[str, dict[str, float]] = {}
            messages = [{"role": "user", "content": tokenizer.decode(haystack_ids(tokenizer, args.tokens, round_))
                         + question}]  # fmt: skip
            with others_paused(list(urls.values())):  # transformers' generate in this process, both servers stopped
                measured["transformers"] = hf.run(messages, QUESTIONS[: args.requests], args.max_tokens)
            yield {"bar": "versus", "side": "transformers", "round": round_, "threads": threads,
                   **{key: round(v, 4) for key, v in measured["transformers"].items()}}  # fmt: skip
            for side in ("kvforge", "vllm") if round_ % 2 == 0 else ("vllm", "kvforge"):
                url = urls[side]
                body = {"model": "m", "max_tokens": args.max_tokens, "temperature": 0, "messages": messages}
                with others_paused([u for name, u in urls.items() if name != side]):
                    cold, _, cold_text, _ = stream(url, "/v1/chat/completions", body)
                    hit, end, hit_text, pieces = stream(url, "/v1/chat/completions", body)
                    start = time.perf_counter()
                    serial = [chat(url, "m", q, args.max_tokens) for q in QUESTIONS[: args.requests]]
                    serial_s = time.perf_counter() - start
                    start = time.perf_counter()
                    with ThreadPoolExecutor(args.requests) as pool:
                        asks = [pool.submit(chat, url, "m", q, args.max_tokens) for q in QUESTIONS[: args.requests]]
                        together = [f.result() for f in asks]
                    together_s = time.perf_counter() - start
                measured[side] = {"cold_ttft_s": cold, "hit_ttft_s": hit,
                                  "decode_s_per_token": (end - hit) / max(pieces - 1, 1),
                                  "sequential_s": serial_s, "concurrent_s": together_s}  # fmt: skip
                yield {"bar": "versus", "side": side, "round": round_, "threads": threads, "tokens": args.tokens,
                       **{key: round(v, 4) for key, v in measured[side].items()}, "hit_pieces": pieces,
                       "same_text_cold_hit": cold_text == hit_text,
                       "sequential_tokens": sum(a["usage"]["completion_tokens"] for a in serial),
                       "concurrent_tokens": sum(a["usage"]["completion_tokens"] for a in together)}  # fmt: skip
            yield {"bar": "versus", "round": round_, "threads": threads, "ratio": round(
                       measured["kvforge"]["cold_ttft_s"] / measured["vllm"]["cold_ttft_s"], 4),
                   **{f"ratio_{key}": round(measured["kvforge"][key] / measured["vllm"][key], 4)
                      for key in measured["kvforge"]},
                   **{f"ratio_vs_transformers_{key}": round(measured["kvforge"][key] / value, 4)
                      for key, value in measured["transformers"].items()}}  # fmt: skip


class _Generate:
    """transformers' own ``model.generate`` on the same weights, greedy, in this process with ``threads`` threads: a
    cold prompt's TTFT and decode seconds per token (from one streamed generation), a list of chats one after another
    and the same chats as one left-padded batch. It has no prefix cache across calls: no hit row."""

    def __init__(self, folder: str, threads: int) -> None:
        import torch

        from kvforge.model import load_model

        torch.set_num_threads(threads)
        self.model, self.tokenizer = load_model(folder)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    def _ids(self, messages: list[dict[str, str]]) -> Any:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)  # fmt: skip

    def run(self, messages: list[dict[str, str]], questions: list[str], max_tokens: int) -> dict[str, float]:
        from transformers.generation.streamers import BaseStreamer

        class Clock(BaseStreamer):  # put() gets the prompt first, then each new token
            def __init__(self) -> None:
                self.times: list[float] = []

            def put(self, value: Any) -> None:
                self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        greedy = {"do_sample": False, "pad_token_id": self.tokenizer.pad_token_id}
        clock, start = Clock(), time.perf_counter()
        self.model.generate(**self._ids(messages), max_new_tokens=max_tokens, streamer=clock, **greedy)
        cold, tokens = clock.times[1] - start, clock.times[1:]
        start = time.perf_counter()
        for q in questions:
            self.model.generate(**self._ids([{"role": "user", "content": q}]), max_new_tokens=max_tokens, **greedy)
        serial_s = time.perf_counter() - start
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=False) for q in questions]  # fmt: skip
        start = time.perf_counter()
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        self.model.generate(**batch, max_new_tokens=max_tokens, **greedy)
        return {"cold_ttft_s": cold, "decode_s_per_token": (tokens[-1] - tokens[0]) / max(len(tokens) - 1, 1),
                "sequential_s": serial_s, "concurrent_s": time.perf_counter() - start}  # fmt: skip


def bench_document(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """N questions on one stored compressed document: all at once vs one after another; answers vs Engine alone."""
    from kvforge import Document, Engine, Request, load_model
    from kvforge.presses import build_press
    from kvforge.serve.translate import split_context_question

    model, tokenizer = load_model(args.model)
    text = (ROOT / "src/kvforge/data/haystack_gutenberg/moby_dick_excerpt.txt").read_text()
    doc = tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids[: args.doc_tokens])
    questions = [f"Question {i}: {q} Answer from the text if you can." for i, q in enumerate(QUESTIONS)]
    questions = (questions * (args.questions // len(questions) + 1))[: args.questions]
    press = {"press": args.press, "compression_ratio": args.compression_ratio}
    with server(kvforge_command(args, args.port, "--reuse", "document", *args.kvforge_args), args.port,
                args.log) as url:  # fmt: skip
        r = httpx.post(url + "/v1/kv/documents", json={"documents": [doc], **press}, timeout=900.0)
        r.raise_for_status()
        opts = {"kvforge": {**press, "query_aware": False}}

        def ask(q: str) -> dict[str, Any]:
            body = {"model": "m", "messages": [{"role": "user", "content": f"{doc}\n\n{q}"}],
                    "max_tokens": args.max_tokens, "temperature": 0, **opts}  # fmt: skip
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=3600.0)
            if r.status_code != 200:  # e.g. a 429: the server's load shedding (raise --timeout on a loaded machine)
                raise RuntimeError(f"{r.status_code} from the server: {r.text[:300]}")
            return r.json()  # type: ignore[no-any-return]

        ask(questions[0])  # warm up
        for round_ in range(args.rounds):
            timings: dict[str, float] = {}
            answers: dict[str, list[str]] = {}
            work: dict[str, dict[str, float]] = {}  # mode -> the model thread's work in it
            for mode in ("serial", "concurrent") if round_ % 2 == 0 else ("concurrent", "serial"):
                out: list[Any] = [None] * len(questions)
                counters, cpu = model_thread(url), cpu_seconds(PIDS[url])
                start = time.perf_counter()
                if mode == "serial":
                    for i, q in enumerate(questions):
                        out[i] = ask(q)
                else:  # all at once; a failed request raises here
                    with ThreadPoolExecutor(len(questions)) as pool:
                        out = list(pool.map(ask, questions))
                timings[mode] = time.perf_counter() - start
                after = model_thread(url)
                work[mode] = {k: round(v - counters.get(k, 0.0), 3) for k, v in after.items()}
                work[mode]["server_cpu_s"] = round(cpu_seconds(PIDS[url]) - cpu, 3)
                answers[mode] = [o["choices"][0]["message"]["content"] for o in out]
                cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in out]
            yield {"bar": "document", "round": round_, "questions": len(questions), "doc_tokens": args.doc_tokens,
                   "serial_s": round(timings["serial"], 4), "concurrent_s": round(timings["concurrent"], 4),
                   "ratio": round(timings["concurrent"] / timings["serial"], 4),
                   "same_answers": answers["serial"] == answers["concurrent"], "cached_tokens": cached[0],
                   "model_thread": work}  # fmt: skip
    engine = Engine(model, tokenizer)  # the server is gone: Engine alone, the same requests
    built = build_press(args.press, compression_ratio=args.compression_ratio)
    alone = []
    for q in questions:
        context, question, system = split_context_question([{"role": "user", "content": f"{doc}\n\n{q}"}])
        request = Request(Document(context, question, system), args.max_tokens, press=built, query_aware=False)
        alone.append(engine.run(request).text)
    yield {"bar": "document", "answers_equal_engine_alone": alone == answers["concurrent"] == answers["serial"]}


def bench_engine_document(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The document bar's loop without the server: ``Engine.run_many`` of the questions vs ``Engine.run`` of each."""
    import torch

    from kvforge import Document, Engine, Request, load_model
    from kvforge.presses import build_press
    from kvforge.reuse.document import DocumentReuse
    from kvforge.store.memory import MemoryStore

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    engine = Engine(model, tokenizer)
    engine.reuse = DocumentReuse(MemoryStore(), engine.model_id, model.device)
    engine.eos_token_ids = []  # every answer runs to --max-tokens
    text = (ROOT / "src/kvforge/data/haystack_gutenberg/moby_dick_excerpt.txt").read_text()
    doc = tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids[: args.doc_tokens])
    press = build_press(args.press, compression_ratio=args.compression_ratio)
    questions = [f"Question {i}: what happens in the passage? Answer briefly." for i in range(args.questions)]

    def request(q: str) -> Request:
        return Request(Document(doc, q), args.max_tokens, press=press, query_aware=False)

    engine.run(request("Store it."))
    for round_ in range(args.rounds):
        measured: dict[str, dict[str, Any]] = {}
        for mode in ("serial", "batched") if round_ % 2 == 0 else ("batched", "serial"):
            before, cpu, start = dict(engine.stats), time.process_time(), time.perf_counter()
            if mode == "serial":
                out = [engine.run(request(q)) for q in questions]
            else:
                out = engine.run_many([request(q) for q in questions])
            measured[mode] = {"wall_s": round(time.perf_counter() - start, 4),
                              "cpu_s": round(time.process_time() - cpu, 4),
                              "texts": [g.text for g in out], "reused_tokens": out[0].reused_tokens,
                              **{k: v - before.get(k, 0) for k, v in engine.stats.items()}}  # fmt: skip
        serial, batched = measured["serial"], measured["batched"]
        yield {"bar": "engine-document", "round": round_, "questions": len(questions), "doc_tokens": args.doc_tokens,
               "ratio": round(batched["wall_s"] / serial["wall_s"], 4),
               "cpu_ratio": round(batched["cpu_s"] / serial["cpu_s"], 4),
               "same_answers": serial.pop("texts") == batched.pop("texts"), "serial": serial, "batched": batched,
               "threads": torch.get_num_threads()}  # fmt: skip


def bench_ttft_inprocess(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The ttft bar without a second process: the server's app (``create_app``, FastAPI's TestClient) in this
    process against ``Engine.prefill``, alternating; the same engine, so only the server's loop and HTTP differ."""
    import torch
    from fastapi.testclient import TestClient

    from kvforge.engine import Engine
    from kvforge.model import load_model
    from kvforge.serve import create_app

    model, tokenizer = load_model(args.model)
    engine = Engine(model, tokenizer)
    engine.prefill(haystack_ids(tokenizer, 64, 998))  # warm up
    with TestClient(create_app(engine, model_name="m", request_timeout_s=3600.0)) as client:
        client.post("/v1/completions", json={"model": "m", "prompt": haystack_ids(tokenizer, 64, 999), "max_tokens": 1})
        for i in range(args.repeats):
            measured: dict[str, tuple[float, float]] = {}
            for side in ("server", "engine") if i % 2 == 0 else ("engine", "server"):
                ids = haystack_ids(tokenizer, args.tokens, 2 * i + (side == "engine"))
                cpu, start = time.process_time(), time.perf_counter()
                if side == "server":
                    r = client.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 1})
                    r.raise_for_status()
                else:
                    int(engine.prefill(ids)[1].argmax(-1))
                measured[side] = time.perf_counter() - start, time.process_time() - cpu
            (served, served_cpu), (alone, alone_cpu) = measured["server"], measured["engine"]
            yield {"bar": "ttft-inprocess", "tokens": args.tokens, "repeat": i, "server_s": round(served, 4),
                   "engine_s": round(alone, 4), "ratio": round(served / alone, 4), "server_cpu_s": round(served_cpu, 3),
                   "engine_cpu_s": round(alone_cpu, 3), "cpu_ratio": round(served_cpu / alone_cpu, 4),
                   "threads": torch.get_num_threads()}  # fmt: skip


BARS = {"ttft": bench_ttft, "versus": bench_versus, "document": bench_document,
        "engine-document": bench_engine_document, "ttft-inprocess": bench_ttft_inprocess}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bar", choices=sorted(BARS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--tokens", type=int, default=2048, help="ttft: prompt tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8, help="versus: short chats per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--vllm-python", default="python", help="versus: the python of vLLM's environment")
    parser.add_argument("--questions", type=int, default=8, help="document: questions")
    parser.add_argument("--doc-tokens", type=int, default=1500, help="document: tokens of the stored document")
    parser.add_argument("--press", default="knorm")
    parser.add_argument("--compression-ratio", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=0, help="engine-document, versus: threads (0: default)")
    parser.add_argument("--kvforge-args", nargs=argparse.REMAINDER, default=[], help="extra `kvforge serve` flags")
    parser.add_argument("--out", type=Path, default=RESULTS / "performance" / "serve_bars.jsonl")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from kvforge.provenance import git_sha

    args.log = ROOT / "runs" / f"serve_bars_{args.bar}.log"  # the servers' output (not a result)
    rows = []
    with args.out.open("a") as out:
        for row in BARS[args.bar](args):
            row |= {"model": args.model, "git_sha": git_sha(), "loadavg": os.getloadavg()}
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    if ratios:
        print(f"[bench] {args.bar}: ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max "
              f"{max(ratios):.3f})", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
