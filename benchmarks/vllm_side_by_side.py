"""vLLM alone, vLLM + kvforge's connector (disk, Redis), after a restart, two servers on one store, and ``kvforge
serve``, side by side on one machine in one run: cold and warm TTFT of 1k/2k/4k-token prompts, then requests per
second for 8 concurrent clients. One JSON line per request, then one per (configuration, measure) summary.

    python benchmarks/vllm_side_by_side.py --model MODEL_FOLDER --out results/vllm/side_by_side.jsonl

Configurations (all fp32, the same weights: ``--model`` is the folder ``kvforge`` dequantised smollm2-135m into):
``vllm`` (its in-memory prefix cache), ``vllm+disk`` / ``vllm+redis`` (kvforge connector on a file / Redis store;
"warm (store)" empties vLLM's memory first with ``/reset_prefix_cache``, so the KV comes from the store),
``vllm restarted`` / ``vllm+disk restarted`` (a new process: only a store remembers), ``vllm+disk 2nd server``
(another process on the same store, running beside the restarted one) and ``kvforge serve`` (prefix reuse on its
own memory + file store; its request timeout raised so that long cold prompts on a busy machine are answered).
Requests alternate between the servers that are up, so load changes on a shared machine hit all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import vllm_servers
from common import RESULTS
from vllm_servers import (
    ask,
    document_prompt,
    exclusive,
    kvforge_server,
    redis_process,
    reset_prefix_cache,
    served_model,
    vllm_server,
    write_line,
)

from kvforge.provenance import git_sha

QUESTION = "What does the narrator say about this passage's main character? Answer in one sentence."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (fp32 safetensors) vLLM serves (required to run)")
    parser.add_argument("--kvforge-model", default="smollm2-135m", help="what kvforge serve loads (same weights)")
    parser.add_argument("--lengths", default="1024,2048,4096", help="prompt sizes in tokens")
    parser.add_argument("--prompts", type=int, default=2, help="distinct prompts per size (each cold once)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients of the throughput phase")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each throughput window")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--redis", default=None, help="Redis URL for vllm+redis (default: a redis-server started here)")
    parser.add_argument("--port", type=int, default=8401, help="first of six ports")
    parser.add_argument("--work", type=Path, default=None, help="folder for stores and logs (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS / "vllm" / "side_by_side.jsonl")
    parser.add_argument("--lock", default=None, help="flock this file exclusively while timing (shared machines)")
    parser.add_argument("--lock-wait", type=float, default=180.0, help="seconds to wait for --lock before going on")
    parser.add_argument(
        "--skip", default="", help="comma-separated configurations or phases (throughput, restarts) to leave out"
    )
    parser.add_argument("--vllm-args", default="", help="extra vLLM server options, e.g. '--enforce-eager'")
    parser.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of every vLLM server, e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=1 (docs/vllm.md)",
    )
    parser.add_argument("--kvforge-args", default="--timeout 3600", help="extra kvforge serve options")
    parser.add_argument(
        "--kvforge-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of kvforge serve, e.g. OMP_NUM_THREADS=1 (vLLM's CPU worker thread count on 2 cores)",
    )
    parser.add_argument("--report", type=Path, default=None, help="print the markdown tables of a results file, only")
    args = parser.parse_args()
    if args.report is not None:
        print(report([json.loads(line) for line in args.report.read_text().splitlines() if line.strip()]))
        return 0
    if not args.model:
        parser.error("--model is required (the fp32 model folder vLLM serves)")
    vllm_servers.VLLM_ARGS[:] = args.vllm_args.split()
    for option, items, env in (("--vllm-env", args.vllm_env, vllm_servers.VLLM_ENV),
                               ("--kvforge-env", args.kvforge_env, vllm_servers.KVFORGE_ENV)):  # fmt: skip
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or not key:
                parser.error(f"{option} takes KEY=VALUE, got {item!r}")
            env[key] = value

    from transformers import AutoTokenizer

    work = args.work or Path(tempfile.mkdtemp(prefix="kvforge-vllm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {
        (n, i): document_prompt(tokenizer, n, offset_words=1500 * (k * args.prompts + i), question=QUESTION)
        for k, n in enumerate(lengths)
        for i in range(args.prompts)
    }
    base = {
        "bench": "vllm_side_by_side",
        "git": git_sha(),
        "model": Path(args.model).name,
        "max_tokens": args.max_tokens,
        "vllm_env": dict(vllm_servers.VLLM_ENV),
        "kvforge_env": dict(vllm_servers.KVFORGE_ENV),
        "vllm_args": args.vllm_args,
    }
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    rows: list[dict] = []

    def record(config: str, phase: str, key: tuple[int, int], result: dict) -> None:
        row = base | {"config": config, "phase": phase, "length": key[0], "prompt": key[1]} | result
        rows.append(row)
        write_line(args.out, row)

    redis_ctx = None
    redis_url = args.redis
    if redis_url is None and "vllm+redis" not in skip:
        redis_ctx = redis_process(args.port + 9, work / "redis")
        redis_url = redis_ctx.__enter__()
    disk = f"file://{work}/disk-store"
    servers = {}
    try:
        first = {
            "vllm": lambda: vllm_server("vllm", args.port, args.model, logs),
            "vllm+disk": lambda: vllm_server("vllm-disk", args.port + 1, args.model, logs, store=disk),
            "vllm+redis": lambda: vllm_server("vllm-redis", args.port + 2, args.model, logs, store=redis_url),
            "kvforge serve": lambda: kvforge_server(
                "kvforge",
                args.port + 3,
                args.kvforge_model,
                f"memory://,file://{work}/kvforge-store",
                logs,
                *args.kvforge_args.split(),
            ),
        }
        servers = start_all({name: make for name, make in first.items() if name not in skip})
        models = {name: served_model(server.url) for name, server in servers.items()}

        # cold, then warm (memory), then warm (store): alternating servers, one prompt size at a time
        for n in lengths:
            with exclusive(args.lock, args.lock_wait):
                for i in range(args.prompts):
                    for name, server in servers.items():
                        record(name, "cold", (n, i), ask(server.url, models[name], prompts[n, i], args.max_tokens))
                    for name, server in servers.items():
                        phase = "warm (store)" if name == "kvforge serve" else "warm (memory)"
                        record(name, phase, (n, i), ask(server.url, models[name], prompts[n, i], args.max_tokens))
                    for name, server in servers.items():
                        if name in ("vllm+disk", "vllm+redis"):
                            reset_prefix_cache(server.url)
                            result = ask(server.url, models[name], prompts[n, i], args.max_tokens)
                            record(name, "warm (store)", (n, i), result)

        # throughput: 8 clients, each asking the stored prompts in turn, one server at a time
        for name, server in servers.items() if "throughput" not in skip else ():
            with exclusive(args.lock, args.lock_wait):
                result = throughput(server.url, models[name], list(prompts.values()), args.clients, args.seconds,
                                    args.max_tokens)  # fmt: skip
            write_line(args.out, base | {"config": name, "phase": f"throughput {args.clients} clients"} | result)

        # restarts: new processes, and a second server on the first's store
        for server in servers.values():
            server.stop()  # SIGTERM: the connectors flush their pending block writes
        later = {
            "vllm restarted": lambda: vllm_server("vllm-restarted", args.port, args.model, logs),
            "vllm+disk restarted": lambda: vllm_server(
                "vllm-disk-restarted", args.port + 1, args.model, logs, store=disk
            ),
            "vllm+disk 2nd server": lambda: vllm_server("vllm-disk-2", args.port + 4, args.model, logs, store=disk),
        }
        if "restarts" in skip:
            later = {}
        servers = start_all({name: make for name, make in later.items() if name.split(" ")[0] not in skip})
        for n in lengths:
            with exclusive(args.lock, args.lock_wait):
                for i in range(args.prompts):
                    for name, server in servers.items():
                        model = served_model(server.url)
                        record(name, "after restart", (n, i), ask(server.url, model, prompts[n, i], args.max_tokens))
        for summary in summarise(rows):
            write_line(args.out, base | summary | {"summary": True})
        return 0
    finally:
        for server in servers.values():
            server.stop()
        if redis_ctx is not None:
            redis_ctx.__exit__(None, None, None)


def start_all(makers: dict) -> dict:
    """Start every server at once (their start-up overlaps), then wait for each."""
    servers = {name: make().start() for name, make in makers.items()}
    for server in servers.values():
        server.wait(timeout_s=1800)
    return servers


def throughput(url: str, model: str, prompts: list, clients: int, seconds: float, max_tokens: int) -> dict:
    """Requests completed by ``clients`` threads asking ``prompts`` in turn during ``seconds`` (after a warm-up
    round that makes every prompt stored)."""
    done: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()

    def client(k: int) -> None:
        nonlocal errors
        i = k
        while time.monotonic() < stop_at:
            try:
                result = ask(url, model, prompts[i % len(prompts)], max_tokens)
                with lock:
                    if time.monotonic() <= stop_at:
                        done.append(result["latency_s"])
            except Exception:
                with lock:
                    errors += 1
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = min(time.monotonic() - start, seconds)
    return {
        "requests": len(done),
        "errors": errors,
        "seconds": seconds,
        "requests_per_s": len(done) / elapsed if elapsed else 0.0,
        "median_latency_s": statistics.median(done) if done else None,
    }


def summarise(rows: list[dict]) -> list[dict]:
    """Median TTFT and cached tokens per (configuration, phase, size); texts compared with the cold answer."""
    out = []
    cold_text = {(r["config"], r["length"], r["prompt"]): r["text"] for r in rows if r["phase"] == "cold"}
    keys = sorted({(r["config"], r["phase"], r["length"]) for r in rows})
    for config, phase, length in keys:
        every = [r for r in rows if (r["config"], r["phase"], r["length"]) == (config, phase, length)]
        group = [r for r in every if r["ttft_s"] is not None and r["prompt_tokens"] is not None]  # answered
        if not group:
            out.append({"config": config, "phase": phase, "length": length, "ttft_s": None, "n": 0,
                        "unanswered": len(every)})  # fmt: skip
            continue
        origin = config.replace(" restarted", "").replace(" 2nd server", "")
        same = [r["text"] == cold_text.get((origin, length, r["prompt"])) for r in group]
        out.append({
            "config": config, "phase": phase, "length": length,
            "prompt_tokens": statistics.median(r["prompt_tokens"] for r in group),
            "ttft_s": statistics.median(t) if (t := [r["ttft_s"] for r in group if r["ttft_s"] is not None]) else None,
            "cached_tokens": statistics.median(r["cached_tokens"] for r in group),
            "decode_s_per_token": statistics.median(d) if (d := [r["decode_s_per_token"] for r in group
                                                                 if r.get("decode_s_per_token")]) else None,
            "same_text_as_cold": all(same), "n": len(group), "unanswered": len(every) - len(group),
        })  # fmt: skip
    return out


def report(records: list[dict]) -> str:
    """Markdown: TTFT (s) per configuration and prompt size, cold / warm / after restart, with cached tokens; then
    throughput. Medians over the prompts of each size."""
    summary = [r for r in records if r.get("summary")]
    if not summary:  # a run stopped before its summary lines: summarise the answers it has
        summary = summarise([r for r in records if "ttft_s" in r and "phase" in r and "length" in r])
    lengths = sorted({r["length"] for r in summary})
    order = ["vllm", "vllm+disk", "vllm+redis", "vllm restarted", "vllm+disk restarted", "vllm+disk 2nd server",
             "kvforge serve"]  # fmt: skip
    phases = ["cold", "warm (memory)", "warm (store)", "after restart"]
    head = "| configuration | measure | " + " | ".join(f"{n} tokens: TTFT s (cached)" for n in lengths) + " |"
    lines = [head, "|" + " --- |" * (2 + len(lengths))]
    for config in order:
        for phase in phases:
            cells = []
            for n in lengths:
                row = next((r for r in summary if (r["config"], r["phase"], r["length"]) == (config, phase, n)), None)
                if row is None:
                    cells.append("")
                    continue
                unanswered = f" ({row['unanswered']} unanswered)" if row.get("unanswered") else ""
                if row["ttft_s"] is None:
                    cells.append("no answer" + unanswered)
                    continue
                same = "" if row["same_text_as_cold"] else " ≠"
                cells.append(
                    f"{row['ttft_s']:.2f} ({int(row['cached_tokens'])}/{int(row['prompt_tokens'])}){same}{unanswered}"
                )
            if any(cells):
                lines.append(f"| {config} | {phase} | " + " | ".join(cells) + " |")
    lines += ["", "| configuration | decode s/token (median of its answers) |", "| --- | --- |"]
    for config in order:
        per_token = [r["decode_s_per_token"] for r in records if r.get("config") == config and "ttft_s" in r
                     and not r.get("summary") and r.get("decode_s_per_token")]  # fmt: skip
        if per_token:
            lines.append(f"| {config} | {statistics.median(per_token):.3f} |")
    throughput_rows = [r for r in records if str(r.get("phase", "")).startswith("throughput")]
    if throughput_rows:
        lines += ["", "| configuration | requests/s, 8 clients | requests in the window | median latency s | errors |",
                  "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in throughput_rows:
        latency = "" if r["median_latency_s"] is None else f"{r['median_latency_s']:.2f}"
        lines.append(f"| {r['config']} | {r['requests_per_s']:.2f} | {r['requests']} | {latency} | {r['errors']} |")
    return "\n".join(lines)  # each JSON line also carries the machine's load average


if __name__ == "__main__":
    sys.exit(main())
