"""Load test for ``kvforge serve``: N concurrent clients for a fixed time, one JSON line of results per scheduler.

Each client loops: pick a prompt (repeated: an exact earlier prompt; document: a question on a document stored at the
start through ``/v1/kv/documents``; paraphrased: an earlier document with its question reworded; new: a new long
document), send a chat completion (streamed for a ``--stream-fraction`` of them), record TTFT (first content delta),
inter-token gaps, latency, ``cached_tokens`` and the answer. A 429 is counted and the client waits
``min(Retry-After, 2 s)``; anything else that is not a complete answer (other status, stream error event, transport
error) is an error, a stream that ends without ``[DONE]`` is an incomplete stream. Greedy answers of repeated prompts
are compared. ``/health`` is probed every 100 ms during the load.

With ``--schedulers serial,batched`` the same load (same seed) runs against a server started with each scheduler, one
after the other, and a last line gives the ratios. ``--long-prompt-tokens 4096`` then measures, per scheduler, the
largest gap between the tokens of a request that is streaming while a 4096-token prompt is prefilled.

    python benchmarks/load.py --model tiny --duration 60                      # starts a server (subprocess)
    OMP_NUM_THREADS=1 python benchmarks/load.py --model smollm2-135m --reuse prefix --schedulers serial,batched \
        --clients 32 --duration 60 --long-prompt-tokens 4096
    python benchmarks/load.py --url http://127.0.0.1:8000 --served-model-name smollm2-135m
    python benchmarks/load.py --model smollm2-135m --big-request-mib 7 --duration 120   # /health during a 7 MiB body

Writes the JSON lines to stdout and appends them to ``results/serve/load.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import resource
import sys
import tempfile
import time
from typing import Any

import httpx
from common import RESULTS, ROOT, Server, append_rows, free_port
from common import cpu_seconds as proc_cpu

TOPICS = ["lighthouse", "orchard", "glacier", "harbour", "observatory", "library", "vineyard", "canyon", "foundry"]
QUESTIONS = [
    ("What is the code of room {r}?", "Tell me the code that room {r} has."),
    ("Which room has the code {c}?", "The code {c} belongs to which room?"),
    ("Who keeps the {t}?", "Name the keeper of the {t}."),
    # a long answer (every fact of the document): drawn with probability --list-questions, never by default
    (
        "List every room of the {t} with its code, one per line.",
        "Give each room of the {t} and its code, one per line.",
    ),
]
SHORT = len(QUESTIONS) - 1  # the short-answer questions come first


def pick_question(rng: random.Random, list_fraction: float) -> int:
    """Index of a question: the list question with probability ``list_fraction``, else a short one uniformly."""
    if list_fraction and rng.random() < list_fraction:
        return SHORT
    return rng.randrange(SHORT)


def make_document(rng: random.Random, num_facts: int) -> tuple[str, dict[str, Any]]:
    topic = rng.choice(TOPICS)
    keeper = rng.choice(["Ada", "Bram", "Chen", "Dara", "Emil", "Farah"]) + f" {rng.randint(10, 99)}"
    codes = {r: f"{rng.randint(1000, 9999)}" for r in range(num_facts)}
    lines = [f"Report on the {topic}, kept by {keeper}."] + [
        f"Room {r} of the {topic} has code {c}." for r, c in codes.items()
    ]
    return " ".join(lines), {"topic": topic, "codes": codes}


class PromptMix:
    """Draws repeated / document / paraphrased / new prompts (fractions ``repeat``, ``document``, ``paraphrase``; the
    rest new)."""

    def __init__(
        self,
        seed: int,
        num_facts: int,
        repeat: float,
        paraphrase: float,
        document: float = 0.0,
        num_documents: int = 0,
        list_questions: float = 0.0,
    ) -> None:
        self.rng = random.Random(seed)
        self.list_questions = list_questions
        self.num_facts, self.repeat, self.paraphrase, self.document = num_facts, repeat, paraphrase, document
        self.sent: list[tuple[str, dict[str, Any], int, int]] = []  # (document, facts, question idx, room)
        self.documents = [make_document(random.Random(seed + 1000 + i), num_facts) for i in range(num_documents)]

    def next(self) -> tuple[str, str, Any]:
        u = self.rng.random()
        if self.documents and u < self.document:
            doc, facts = self.rng.choice(self.documents)
            kind, q, room, wording = (
                "document",
                pick_question(self.rng, self.list_questions),
                self.rng.randrange(self.num_facts),
                0,
            )
        elif self.sent and u < self.document + self.repeat:
            kind, (doc, facts, q, room) = "repeated", self.rng.choice(self.sent)
            wording = 0
        elif self.sent and u < self.document + self.repeat + self.paraphrase:
            kind, (doc, facts, q, room) = "paraphrased", self.rng.choice(self.sent)
            wording = 1
        else:
            doc, facts = make_document(self.rng, self.num_facts)
            q = pick_question(self.rng, self.list_questions)
            kind, room, wording = "new", self.rng.randrange(self.num_facts), 0
        question = QUESTIONS[q][wording].format(r=room, c=facts["codes"][room], t=facts["topic"])
        return kind, f"{doc}\n\n{question}", (doc, facts, q, room)

    def answered(self, kind: str, item: Any) -> None:
        """Only prompts the server answered are repeated later (a refused one was never cached)."""
        if kind == "new":
            self.sent.append(item)


class Stats:
    def __init__(self) -> None:
        self.ok: list[dict[str, Any]] = []
        self.rejected = 0
        self.errors: list[str] = []
        self.incomplete = 0  # streams that ended without [DONE]
        self.answers: dict[str, set[str]] = {}  # prompt -> distinct greedy answers
        self.asked: dict[str, int] = {}  # prompt -> times answered


async def one_request(
    http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, press: str | None, stream: bool = True
) -> Any:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if press:
        body["kvforge"] = {"press": press}
    start = time.perf_counter()
    if not stream:
        r = await http.post("/v1/chat/completions", json=body)
        if r.status_code == 429:
            return 429, float(r.headers.get("retry-after", "1"))
        if r.status_code != 200:
            return "error", f"HTTP {r.status_code}: {r.content[:200]!r}"
        out = r.json()
        latency = time.perf_counter() - start
        return "ok", {
            "ttft_s": latency,
            "latency_s": latency,
            "usage": out["usage"],
            "kvforge": out.get("kvforge") or {},
            "text": out["choices"][0]["message"]["content"],
            "stream": False,
            "gaps": [],
        }
    ttft, usage, kvf, done = None, None, None, False
    pieces: list[str] = []
    times: list[float] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code == 429:
            await r.aread()
            return 429, float(r.headers.get("retry-after", "1"))
        if r.status_code != 200:
            return "error", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return "error", f"stream error: {event['error'].get('message')}"
            if event.get("usage"):
                usage = event["usage"]
            kvf = event.get("kvforge", kvf)
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                ttft = now - start if ttft is None else ttft
                times.append(now)
                pieces.append(event["choices"][0]["delta"]["content"])
    latency = time.perf_counter() - start
    if not done or usage is None:
        return "incomplete", "stream ended without [DONE] and usage"
    return "ok", {
        "ttft_s": ttft if ttft is not None else latency,
        "latency_s": latency,
        "usage": usage,
        "kvforge": kvf or {},
        "text": "".join(pieces),
        "stream": True,
        "gaps": [b - a for a, b in itertools.pairwise(times)],
    }


async def client_loop(
    idx: int, args: argparse.Namespace, url: str, mix: PromptMix, stats: Stats, stop_at: float
) -> None:
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers) as http:
        while time.perf_counter() < stop_at:
            kind, prompt, item = mix.next()
            stream = mix.rng.random() < args.stream_fraction
            try:
                status, result = await one_request(
                    http, args.served_model_name, prompt, args.max_tokens, args.press, stream
                )
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                status, result = "error", f"{type(e).__name__}: {e}"
            if status == 429:
                stats.rejected += 1
                await asyncio.sleep(min(result, 2.0) * (0.5 + mix.rng.random()))
            elif status == "incomplete":
                stats.incomplete += 1
            elif status == "error":
                stats.errors.append(result)
            else:
                result["kind"], result["end"] = kind, time.perf_counter()
                stats.ok.append(result)
                stats.answers.setdefault(prompt, set()).add(result.pop("text"))
                stats.asked[prompt] = stats.asked.get(prompt, 0) + 1
                mix.answered(kind, item)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def summarize(
    stats: Stats, elapsed: float, args: argparse.Namespace, window_end: float = float("inf")
) -> dict[str, Any]:
    ok = stats.ok
    hit = [r for r in ok if r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0]
    by_kind = {}
    for kind in ("repeated", "document", "paraphrased", "new"):
        rows = [r for r in ok if r["kind"] == kind]
        hits = [r for r in rows if r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0]
        by_kind[kind] = {
            "requests": len(rows),
            "hit_rate": round(len(hits) / len(rows), 3) if rows else None,
            "server_ttft_p50_s": percentile([r["kvforge"]["ttft_s"] for r in rows if "ttft_s" in r["kvforge"]], 0.5),
        }
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in ok)
    gaps = [g for r in ok for g in r["gaps"]]
    asked = len(stats.answers)
    cached = sum(r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in ok)
    return {
        "bench": "serve_load",
        "config": {k: v for k, v in vars(args).items() if k not in ("api_key",)},
        "duration_s": round(elapsed, 1),
        "completed": len(ok),
        "completed_in_window": sum(r["end"] <= window_end for r in ok),  # answered within --duration
        "rejected_429": stats.rejected,
        "errors": len(stats.errors),
        "error_samples": stats.errors[:3],
        "incomplete_streams": stats.incomplete,
        "share_429": round(stats.rejected / (stats.rejected + len(ok) + len(stats.errors)), 3) if ok else None,
        "streamed": sum(r["stream"] for r in ok),
        "distinct_prompts": asked,
        "prompts_asked_twice_or_more": sum(1 for p in stats.answers if stats.asked.get(p, 0) > 1),
        "prompts_with_differing_greedy_answers": sum(len(a) > 1 for a in stats.answers.values()),
        "throughput_rps": round(len(ok) / elapsed, 3),
        "completion_tokens_per_s": round(sum(r["usage"]["completion_tokens"] for r in ok) / elapsed, 2),
        "ttft_p50_s": percentile([r["ttft_s"] for r in ok], 0.5),
        "ttft_p99_s": percentile([r["ttft_s"] for r in ok], 0.99),
        "itl_p50_s": percentile(gaps, 0.5),
        "itl_p99_s": percentile(gaps, 0.99),
        "server_ttft_p50_s": percentile([r["kvforge"]["ttft_s"] for r in ok if "ttft_s" in r["kvforge"]], 0.5),
        "server_ttft_p99_s": percentile([r["kvforge"]["ttft_s"] for r in ok if "ttft_s" in r["kvforge"]], 0.99),
        "latency_p50_s": percentile([r["latency_s"] for r in ok], 0.5),
        "latency_p99_s": percentile([r["latency_s"] for r in ok], 0.99),
        "hit_rate": round(len(hit) / len(ok), 3) if ok else None,
        "cached_token_fraction": round(cached / prompt_tokens, 3) if prompt_tokens else None,
        "by_kind": by_kind,
        "approximate_answers": sum(1 for r in ok if r["kvforge"].get("approximate")),
    }


def start_server(args: argparse.Namespace, scheduler: str = "batched") -> Server:
    """``kvforge serve`` on ``args.model`` (``tiny``: the tiny random model, saved to a folder), ready to answer; its
    output goes to ``runs/load-serve.log``."""
    model = args.model
    if model == "tiny":  # save the tiny random model so the server loads it like any folder
        sys.path.insert(0, str(ROOT / "src"))
        from kvforge.testing import tiny_model, tiny_tokenizer

        model = tempfile.mkdtemp(prefix="kvforge-tiny-")
        tiny_model("llama").save_pretrained(model)
        tiny_tokenizer().save_pretrained(model)
    port = args.port or free_port()
    cmd = [sys.executable, "-m", "kvforge.cli", "serve", "--model", model, "--port", str(port), "--served-model-name",
           args.served_model_name, "--reuse", args.reuse, "--max-queue", str(args.max_queue), "--device", "cpu",
           "--timeout", str(args.request_timeout), "--scheduler", scheduler, "--max-running", str(args.max_running),
           "--prefill-budget", str(args.prefill_budget), *(["--store", args.store] if args.store else [])]  # fmt: skip
    return Server("load-serve", cmd, port, ROOT / "runs").start().wait(300)


async def probe_health(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    """``/health`` every 100 ms until ``stop`` (a failed probe counts as infinite)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                ok = (await http.get("/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - t if ok else float("inf"))
            await asyncio.sleep(0.1)


async def store_documents(url: str, args: argparse.Namespace, mix: PromptMix) -> None:
    if not mix.documents:
        return
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as http:
        r = await http.post("/v1/kv/documents", json={"documents": [d for d, _ in mix.documents]})
        if r.status_code != 200:
            raise SystemExit(f"storing the documents failed: HTTP {r.status_code} {r.text[:200]}")


async def warm_up(url: str, args: argparse.Namespace, mix: PromptMix, stats: Stats) -> None:
    """Answer ``--warmup-prompts`` new prompts one at a time before the timed window (not counted), so that repeats
    can be drawn from the start: the same prompts for every scheduler (same seed), whatever it answers later."""
    if not args.warmup_prompts:
        return
    rng = random.Random(args.seed + 7)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as http:
        for _ in range(args.warmup_prompts):
            doc, facts = make_document(rng, args.num_facts)
            q, room = pick_question(rng, args.list_questions), rng.randrange(args.num_facts)
            question = QUESTIONS[q][0].format(r=room, c=facts["codes"][room], t=facts["topic"])
            prompt = f"{doc}\n\n{question}"
            status, result = await one_request(http, args.served_model_name, prompt, args.max_tokens, args.press, False)
            if status != "ok":
                raise SystemExit(f"warm-up request failed: {status} {result}")
            mix.answered("new", (doc, facts, q, room))
            stats.answers.setdefault(prompt, set()).add(result["text"])  # repeats must give this answer again
            stats.asked[prompt] = stats.asked.get(prompt, 0) + 1


async def run(args: argparse.Namespace, url: str, server_pid: int | None = None) -> dict[str, Any]:
    mix = PromptMix(
        args.seed, args.num_facts, args.repeat, args.paraphrase, args.document, args.num_documents, args.list_questions
    )
    stats = Stats()
    await store_documents(url, args, mix)
    await warm_up(url, args, mix, stats)
    stop, health = asyncio.Event(), []
    prober = asyncio.ensure_future(probe_health(url, stop, health))
    async with httpx.AsyncClient(base_url=url) as http:
        profile_before = model_thread_profile((await http.get("/metrics")).text)
    load_before, cpu_before = os.getloadavg()[0], cpu_seconds(server_pid)
    start = time.perf_counter()
    await asyncio.gather(*(client_loop(i, args, url, mix, stats, start + args.duration) for i in range(args.clients)))
    elapsed = time.perf_counter() - start
    load_after, cpu_after = os.getloadavg()[0], cpu_seconds(server_pid)
    stop.set()
    await prober
    result = summarize(stats, elapsed, args, start + args.duration)
    result["loadavg_1m_before_after"] = [round(load_before, 2), round(load_after, 2)]
    result["cpu_s"] = {k: round(cpu_after[k] - cpu_before[k], 1) for k in cpu_after}  # during the load
    result["health_p50_ms"] = round(1000 * (percentile(health, 0.5) or 0), 1)
    result["health_p99_ms"] = round(1000 * (percentile(health, 0.99) or 0), 1)
    result["health_max_ms"] = round(1000 * max(health), 1) if health else None
    result["health_over_100ms_share"] = round(sum(x > 0.1 for x in health) / len(health), 3) if health else None
    async with httpx.AsyncClient(base_url=url) as http:
        metrics = (await http.get("/metrics")).text
    result["server_aborted"] = sum(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("kvforge_aborted_total")
    )
    result["model_thread"] = profile_delta(profile_before, model_thread_profile(metrics))
    return result


def cpu_seconds(server_pid: int | None) -> dict[str, float]:
    """CPU seconds used so far by this (client) process and by the server process (when started here)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"client": usage.ru_utime + usage.ru_stime} | ({"server": proc_cpu(server_pid)} if server_pid else {})


def profile_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the model thread did between two profiles (the load, without the documents stored before it)."""
    seconds = {k: round(v - before["seconds"].get(k, 0.0), 2) for k, v in after["seconds"].items()}
    counts = {k: v - before.get(k, 0) for k, v in after.items() if k != "seconds"}
    if counts.get("steps"):
        counts["mean_decode_rows"] = round(counts.get("decode_rows", 0) / counts["steps"], 2)
        counts["mean_prefill_tokens"] = round(counts.get("prefill_tokens", 0) / counts["steps"], 1)
    return {"seconds": seconds, **counts}


def model_thread_profile(metrics: str) -> dict[str, Any]:
    """The server's model-thread profile from ``/metrics``: seconds per phase and counts (since the server started)."""
    seconds, counts = {}, {}
    for line in metrics.splitlines():
        if line.startswith("kvforge_model_thread_seconds_total{"):
            phase = line.split('phase="')[1].split('"')[0]
            seconds[phase] = round(float(line.split()[-1]), 2)
        elif line.startswith("kvforge_model_thread_") and line.split()[0].endswith("_total"):
            counts[line.split()[0].removeprefix("kvforge_model_thread_").removesuffix("_total")] = int(
                float(line.split()[-1])
            )
    return {"seconds": seconds, **counts}


async def gap_during_long_prefill(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Largest gap between a streaming request's tokens while a ``--long-prompt-tokens`` prompt is prefilled.

    Watchers (raw completions counting upwards, so they run long) stream one after the other; once the first has
    shown 3 tokens the long prompt is sent; the gaps of every watcher token received until the long prompt's answer
    count (its prefill and its few tokens of decoding).
    """
    words = " ".join(f"w{i}" for i in range(int(args.long_prompt_tokens / 4.5)))  # ~4.5 tokens per "w123"
    long_body = {"model": args.served_model_name, "prompt": words, "max_tokens": 1, "temperature": 0}
    watch_body = {
        "model": args.served_model_name,
        "prompt": ", ".join(str(i) for i in range(1, 40)) + ",",
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
    }
    times: list[list[float]] = []
    done = asyncio.Event()
    started = asyncio.Event()

    async def watch(http: httpx.AsyncClient) -> None:
        while not done.is_set():
            mine: list[float] = []
            times.append(mine)
            async with http.stream("POST", "/v1/completions", json=watch_body) as r:
                if r.status_code != 200:
                    raise SystemExit(f"watcher request failed: HTTP {r.status_code} {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"text": ""' not in line:
                        mine.append(time.perf_counter())
                        if len(mine) >= 3:
                            started.set()
                    if done.is_set():
                        break

    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout * 4) as http:
        watcher = asyncio.ensure_future(watch(http))
        await asyncio.wait_for(started.wait(), timeout=args.request_timeout)
        t0 = time.perf_counter()
        r = await http.post("/v1/completions", json=long_body)
        t1 = time.perf_counter()
        done.set()
        await asyncio.wait_for(watcher, timeout=args.request_timeout)
    gaps = []
    for ts in times:  # from each watcher's last token before t0 (the gap spanning t0 counts) to t1
        before = [t for t in ts if t < t0]
        inside = before[-1:] + [t for t in ts if t0 <= t <= t1]
        gaps += [b - a for a, b in itertools.pairwise(inside)]
        if inside and ts[-1] > t1:  # still streaming at t1: the wait since its last token counts too
            gaps.append(t1 - inside[-1])
    num_inside = sum(t0 <= t <= t1 for ts in times for t in ts)
    return {
        "long_prompt_status": r.status_code,
        "long_prompt_tokens": r.json().get("usage", {}).get("prompt_tokens") if r.status_code == 200 else None,
        "long_prompt_s": round(t1 - t0, 2),
        "watcher_tokens_during_long_prompt": num_inside,
        "watcher_max_gap_s": round(max(gaps), 3) if gaps else None,
    }


async def health_during_big_request(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """``/health`` latency while one ``--big-request-mib`` MiB chat message is sent and processed."""
    content = "word " * int(args.big_request_mib * 2**20 / 5)
    body = {"model": args.served_model_name, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    data = json.dumps(body).encode()
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as http:
        t0 = time.perf_counter()
        big = asyncio.ensure_future(  # sent from another thread: the probes' loop does not also upload 7 MiB
            asyncio.to_thread(
                httpx.post,
                url + "/v1/chat/completions",
                content=data,
                headers={"content-type": "application/json"},
                timeout=args.request_timeout,
            )
        )
        deadline = t0 + args.duration
        while not big.done() and time.perf_counter() < deadline and len(latencies) < 10_000:
            t = time.perf_counter()
            try:
                ok = (await http.get("/health", timeout=10)).status_code == 200
            except httpx.TransportError:
                ok = False
            if not big.done():  # only probes answered while the big request was still in flight count
                latencies.append(time.perf_counter() - t if ok else float("inf"))
            await asyncio.sleep(0.05)
        response = await big
        elapsed = time.perf_counter() - t0
    return {
        "bench": "health_during_big_request",
        "model": args.model,
        "big_request_mib": args.big_request_mib,
        "big_request_status": response.status_code,
        "big_request_s": round(elapsed, 3),
        "health_probes_in_flight": len(latencies),
        "health_p50_ms": round(1000 * percentile(latencies, 0.5), 1) if latencies else None,
        "health_max_ms": round(1000 * max(latencies), 1) if latencies else None,
        "health_over_100ms": sum(x > 0.1 for x in latencies),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--model", default="tiny", help="tiny | smollm2-135m | folder (when starting a server)")
    p.add_argument("--served-model-name", default="kvforge-load")
    p.add_argument("--reuse", default="none", choices=["none", "prefix", "semantic"])
    p.add_argument("--store", default=None)
    p.add_argument("--press", default=None, help="per-request press")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--num-facts", type=int, default=20, help="facts per document (sets the prompt length)")
    p.add_argument("--repeat", type=float, default=0.3, help="fraction of exact repeats")
    p.add_argument("--paraphrase", type=float, default=0.3, help="fraction of reworded questions on a seen document")
    p.add_argument("--document", type=float, default=0.0, help="fraction of questions on documents stored at start")
    p.add_argument(
        "--list-questions",
        type=float,
        default=0.0,
        help="fraction of questions asking for every room and code (long answers, as chat traffic's; default: none)",
    )
    p.add_argument("--num-documents", type=int, default=8, help="documents stored through /v1/kv/documents")
    p.add_argument(
        "--warmup-prompts", type=int, default=0, help="new prompts answered before the timed window (repeat pool)"
    )
    p.add_argument("--stream-fraction", type=float, default=1.0, help="fraction of requests that stream")
    p.add_argument("--schedulers", default="batched", help="comma list of server schedulers to run: serial,batched")
    p.add_argument("--max-running", type=int, default=16, help="server --max-running (batched)")
    p.add_argument("--prefill-budget", type=int, default=128, help="server --prefill-budget (batched)")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument(
        "--long-prompt-tokens", type=int, default=0, help="after the load: streaming gaps while this prompt prefills"
    )
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--big-request-mib",
        type=float,
        default=None,
        help="instead of the load: /health latency during one big request",
    )
    args = p.parse_args()
    results = []
    for scheduler in args.schedulers.split(",") if args.url is None else ["(external)"]:
        srv = start_server(args, scheduler) if args.url is None else None
        url = srv.url if srv is not None else args.url
        proc = srv.process if srv is not None else None
        try:
            if args.big_request_mib:
                result = asyncio.run(health_during_big_request(args, url.rstrip("/")))
            else:
                result = asyncio.run(run(args, url.rstrip("/"), proc.pid if proc is not None else None))
            if args.long_prompt_tokens and not args.big_request_mib and scheduler != "serial":
                # (serial: the long prompt would wait for the watcher's end, there is nothing to interleave)
                result |= asyncio.run(gap_during_long_prefill(args, url.rstrip("/")))
        finally:
            if srv is not None:
                srv.stop(30)
        result["scheduler"] = scheduler
        results.append(result)
        emit(result)
    by = {r["scheduler"]: r for r in results}
    if "serial" in by and "batched" in by and not args.big_request_mib:
        emit(
            {
                "bench": "serve_load_compare",
                "requests_ratio_batched_over_serial": round(
                    by["batched"]["completed"] / max(by["serial"]["completed"], 1), 2
                ),
                "tokens_per_s_ratio": round(
                    by["batched"]["completion_tokens_per_s"] / max(by["serial"]["completion_tokens_per_s"], 1e-9), 2
                ),
                "completed": {k: v["completed"] for k, v in by.items()},
                "in_window_ratio_batched_over_serial": round(
                    by["batched"]["completed_in_window"] / max(by["serial"]["completed_in_window"], 1), 2
                ),
                "completed_in_window": {k: v["completed_in_window"] for k, v in by.items()},
                "loadavg_1m": {k: v["loadavg_1m_before_after"] for k, v in by.items()},
            }
        )
    return 0


def emit(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)
    append_rows(RESULTS / "serve" / "load.jsonl", result)


if __name__ == "__main__":
    sys.exit(main())
