"""The server's latency bars, each measured in one run alternating the two sides (one JSON line per measurement).

- ``ttft``: a lone cold prompt (``--tokens`` ids, a new one each time) streamed by ``kvforge serve`` (the default
  batched scheduler) to its first token, against a lone ``Engine`` prefill of the same ids in this process.
- ``sequential``: ``--requests`` short chat requests sent one after another to ``kvforge serve`` and to vLLM's
  OpenAI server (its CPU build, from ``--vllm-python``) on the same weights, alternating rounds.
- ``document``: ``--questions`` questions on one document stored compressed (query-agnostic press, through
  ``POST /v1/kv/documents``), sent all at once against one after another; the greedy answers are compared with
  ``Engine`` alone.

    PYTHONPATH=src python benchmarks/serve_bars.py ttft --tokens 2048 --repeats 3
    PYTHONPATH=src python benchmarks/serve_bars.py sequential --vllm-python VENV/bin/python --rounds 3
    PYTHONPATH=src python benchmarks/serve_bars.py document --questions 8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
             "What is 12 times 12?", "Who wrote Hamlet?", "What is the boiling point of water?",
             "Name a planet with rings.", "What language is spoken in Brazil?"]  # fmt: skip


@contextmanager
def server(command: list[str], port: int, log: Path, ready: str = "/v1/models", timeout_s: float = 900.0
           ) -> Iterator[str]:  # fmt: skip
    """Start ``command`` (a server on ``port``), wait until ``ready`` answers, stop it (SIGTERM, then SIGKILL)."""
    env = os.environ | {"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with log.open("ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url, start = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[:4]} exited with {proc.returncode}: see {log}")
            try:
                if httpx.get(url + ready, timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"no answer from {url} in {timeout_s:.0f} s")
            time.sleep(1.0)
        print(f"[bench] {command[2]} ready in {time.monotonic() - start:.0f} s", file=sys.stderr)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kvforge_command(args: argparse.Namespace, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvforge", "serve", "--model", args.model, "--port", str(port),
            "--served-model-name", "m", *extra]  # fmt: skip


def stream(url: str, path: str, body: dict[str, Any]) -> tuple[float, float, str]:
    """(seconds to the first generated text, seconds to the end, text) of a streamed request."""
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
    return (first if first is not None else end), end, "".join(text)


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
    with server(kvforge_command(args, args.port, *args.kvforge_args), args.port, args.log) as url:
        stream(url, "/v1/completions", {"model": "m", "prompt": haystack_ids(tokenizer, 64, 999), "max_tokens": 2})
        for i in range(args.repeats):
            ids = haystack_ids(tokenizer, args.tokens, 2 * i)
            served, _, _ = stream(url, "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 1})
            ids = haystack_ids(tokenizer, args.tokens, 2 * i + 1)
            start = time.perf_counter()
            _, logits = engine.prefill(ids)
            int(logits.argmax(-1))
            alone = time.perf_counter() - start
            yield {"bar": "ttft", "tokens": args.tokens, "repeat": i, "server_ttft_s": round(served, 4),
                   "engine_ttft_s": round(alone, 4), "ratio": round(served / alone, 4),
                   "threads": torch.get_num_threads(), "kvforge_args": args.kvforge_args}  # fmt: skip


def bench_sequential(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """``--requests`` short chats one after another, kvforge and vLLM alternating rounds on the same weights."""
    from kvforge.model import load_model

    model, _ = load_model(args.model)
    folder = str(Path(model.config._name_or_path))
    vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--dtype", "float32",
            "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(args.port + 1),
            "--served-model-name", "m"]  # fmt: skip
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    del model
    with (
        server(kvforge_command(args, args.port, *args.kvforge_args), args.port, args.log) as kv_url,
        server(vllm, args.port + 1, args.log, timeout_s=1200.0) as vllm_url,
    ):
        sides = {"kvforge": kv_url, "vllm": vllm_url}
        for url in sides.values():
            chat(url, "m", "Hello!", 4)  # warm up
        for round_ in range(args.rounds):
            totals: dict[str, float] = {}
            for name in ("kvforge", "vllm") if round_ % 2 == 0 else ("vllm", "kvforge"):
                start = time.perf_counter()
                answers = [chat(sides[name], "m", q, args.max_tokens) for q in QUESTIONS[: args.requests]]
                totals[name] = time.perf_counter() - start
                tokens = sum(a["usage"]["completion_tokens"] for a in answers)
                yield {"bar": "sequential", "side": name, "round": round_, "requests": args.requests,
                       "seconds": round(totals[name], 4), "completion_tokens": tokens}  # fmt: skip
            yield {"bar": "sequential", "round": round_, "ratio": round(totals["kvforge"] / totals["vllm"], 4),
                   "kvforge_args": args.kvforge_args}  # fmt: skip


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
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=900.0).json()  # type: ignore[no-any-return]

        ask(questions[0])  # warm up
        for round_ in range(args.rounds):
            timings: dict[str, float] = {}
            answers: dict[str, list[str]] = {}
            for mode in ("serial", "concurrent") if round_ % 2 == 0 else ("concurrent", "serial"):
                out: list[Any] = [None] * len(questions)
                start = time.perf_counter()
                if mode == "serial":
                    for i, q in enumerate(questions):
                        out[i] = ask(q)
                else:
                    threads = [threading.Thread(target=lambda i=i, q=q, out=out: out.__setitem__(i, ask(q)))
                               for i, q in enumerate(questions)]  # fmt: skip
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                timings[mode] = time.perf_counter() - start
                answers[mode] = [o["choices"][0]["message"]["content"] for o in out]
                cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in out]
            yield {"bar": "document", "round": round_, "questions": len(questions), "doc_tokens": args.doc_tokens,
                   "serial_s": round(timings["serial"], 4), "concurrent_s": round(timings["concurrent"], 4),
                   "ratio": round(timings["concurrent"] / timings["serial"], 4),
                   "same_answers": answers["serial"] == answers["concurrent"], "cached_tokens": cached[0]}  # fmt: skip
    engine = Engine(model, tokenizer)  # the server is gone: Engine alone, the same requests
    built = build_press(args.press, compression_ratio=args.compression_ratio)
    alone = []
    for q in questions:
        context, question, system = split_context_question([{"role": "user", "content": f"{doc}\n\n{q}"}])
        request = Request(Document(context, question, system), args.max_tokens, press=built, query_aware=False)
        alone.append(engine.run(request).text)
    yield {"bar": "document", "answers_equal_engine_alone": alone == answers["concurrent"] == answers["serial"]}


BARS = {"ttft": bench_ttft, "sequential": bench_sequential, "document": bench_document}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bar", choices=sorted(BARS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--tokens", type=int, default=2048, help="ttft: prompt tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8, help="sequential: requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--vllm-python", default="python", help="sequential: the python of vLLM's environment")
    parser.add_argument("--questions", type=int, default=8, help="document: questions")
    parser.add_argument("--doc-tokens", type=int, default=1500, help="document: tokens of the stored document")
    parser.add_argument("--press", default="knorm")
    parser.add_argument("--compression-ratio", type=float, default=0.5)
    parser.add_argument("--kvforge-args", nargs=argparse.REMAINDER, default=[], help="extra `kvforge serve` flags")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_bars.jsonl")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.log = args.out.parent / f"serve_bars_{args.bar}.log"
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    rows = []
    with args.out.open("a") as out:
        for row in BARS[args.bar](args):
            row |= {"model": args.model, "git_sha": sha.strip()}
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
