"""Compressed documents inside vLLM, side by side: vLLM alone (its prefix cache), vLLM + LMCache (when its CPU path
runs), vLLM + kvforge full prefix blocks, vLLM + kvforge kvtc prefix blocks, vLLM + kvforge compressed documents.

Per configuration, one JSON line each: stored bytes per document, TTFT of a new question on a stored document,
decode seconds per token, KV slots per sequence (vLLM's usage: prompt + generated tokens), normalised score on needle
sets (against vLLM's own full prefill of the same token ids), and, in a fixed KV space, how many questions on distinct
documents run at once without preemption (vLLM's /metrics). Servers run one at a time (the others are stopped).

    M=$(python -c "from kvforge.model import model_folder; print(model_folder('smollm2-135m'))")
    python benchmarks/vllm_documents.py --model "$M" --data-dir DATA_DIR --out runs/vllm_documents.jsonl
    python benchmarks/vllm_documents.py --report runs/vllm_documents.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from common import RESULTS
from vllm_servers import Server, events, reset_prefix_cache, vllm_server

from kvforge.eval.metrics import score_prediction
from kvforge.eval.tasks import TASKS, TaskConfig
from kvforge.paths import bundled_data_dir
from kvforge.request import encode_qa
from kvforge.vllm.client import VllmDocuments

STORE_BLOCK = 256  # tokens per block the connector stores (its default block_size)
TEXT_SAMPLE = next(iter(sorted((bundled_data_dir() / "haystack_gutenberg").glob("*.txt")))).read_text()[:4000]


def examples(args: argparse.Namespace, tokenizer: Any) -> list[tuple[str, Any]]:
    """(set name, example) for every ``--set NAME=TASK:SEEDS[:HAYSTACK,...]``."""
    out = []
    for spec in args.set:
        name, _, rest = spec.partition("=")
        task, seeds, *hay = rest.split(":")
        haystack = tuple(Path(args.data_dir) / h for h in hay[0].split(",")) if hay else None
        for seed in (int(s) for s in seeds.split(",")):
            cfg = TaskConfig(
                Path(args.data_dir),
                tokenizer=tokenizer,
                seed=seed,
                lengths=(args.length,),
                depths=tuple(args.depths),
                num_samples=1,
                haystack=haystack,
            )
            out += [(name, ex) for ex in TASKS[task](cfg)]
    return out[: args.limit] if args.limit else out


def complete(
    url: str, model: str, prompt: list[int], max_tokens: int, params: dict | None = None, ignore_eos: bool = False
) -> dict[str, Any]:
    """One greedy streamed completion on token ids: TTFT, decode s/token, text, usage."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if params:
        body["kv_transfer_params"] = params
    start = time.perf_counter()
    ttft, pieces, usage = None, [], {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{url} answered {answer.status_code}: {answer.read().decode()[:300]}")
        for event in events(answer):
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                if choice.get("text") and ttft is None:
                    ttft = time.perf_counter() - start
                pieces.append(choice.get("text") or "")
    latency = time.perf_counter() - start
    generated = usage.get("completion_tokens") or 0
    return {
        "ttft_s": ttft if ttft is not None else latency,
        "text": "".join(pieces),
        "decode_s_per_token": (latency - ttft) / (generated - 1) if ttft and generated > 1 else None,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": generated,
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def metric(url: str, name: str) -> float:
    """The sum of a series of vLLM's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def at_once(url: str, model: str, prompts: list[tuple[list[int], dict | None]], max_tokens: int) -> dict[str, Any]:
    """Send every prompt at once; the most requests vLLM ran together and the preemptions it needed."""
    before = metric(url, "vllm:num_preemptions_total")
    peak = [0.0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], metric(url, "vllm:num_requests_running"))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    results: list[dict] = [{}] * len(prompts)

    def one(i: int) -> None:
        results[i] = complete(url, model, prompts[i][0], max_tokens, prompts[i][1], ignore_eos=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    return {
        "requests": len(prompts),
        "max_running": int(peak[0]),
        "preemptions": int(metric(url, "vllm:num_preemptions_total") - before),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def fp16_bytes(num_tokens: int, config: Any) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return num_tokens * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2


def start(name: str, args: argparse.Namespace, log_dir: Path, store: str | None, **extra: Any) -> Server:
    server = vllm_server(name, args.port, args.model, log_dir, store, **extra)
    if args.enforce_eager:
        server.command.append("--enforce-eager")
    return server.start().wait()


def run(args: argparse.Namespace) -> None:
    from transformers import AutoConfig

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kvforge-vllm-docs-"))
    out = open(args.out, "a")  # noqa: SIM115

    def emit(row: dict[str, Any]) -> None:
        row = {"bench": "vllm_documents", **row}
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row), file=sys.stderr)

    import torch

    if args.compress_threads:  # kvforge's engine in this process; the servers choose their own threads
        torch.set_num_threads(args.compress_threads)
    config = AutoConfig.from_pretrained(args.model)
    docs_url, kvtc_url = f"file://{work}/docs", f"file://{work}/kvtc"
    client = VllmDocuments.for_model(args.model, docs_url, args.press, args.compression_ratio, args.quant)
    sets = examples(args, client.tokenizer)
    stored = []
    for i, (name, ex) in enumerate(sets):  # compress once, in kvforge's engine (no server running)
        t0 = time.perf_counter()
        (doc,) = client.add([ex.context], system=ex.system)
        match = client.match(ex.context, ex.question, ex.system, ex.answer_prefix)
        ctx_ids, q_ids = encode_qa(client.tokenizer, ex.context, ex.question, ex.system, ex.answer_prefix)
        stored.append(
            {
                "set": name,
                "ex": ex,
                "doc": doc,
                "match": match,
                "full": ctx_ids + q_ids,
                "bytes": client.store.stored_size(doc.key),
                "fp16": fp16_bytes(doc.num_tokens, config),
            }
        )
        print(f"[bench] stored {i + 1}/{len(sets)} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    client.store.close()
    engine, client.engine = client.engine, None
    del engine
    model = args.model
    base = {
        "press": args.press,
        "compression_ratio": args.compression_ratio,
        "quant": args.quant,
        "length": args.length,
        "examples": len(stored),
    }

    def quality(url: str, kind: str) -> list[dict]:
        rows = []
        for s in stored:
            ex = s["ex"]
            if kind == "documents":
                r = complete(url, model, s["match"].prompt_ids, ex.max_new_tokens, s["doc"].params())
                r["loaded"] = r["cached_tokens"] >= s["doc"].num_slots
            else:
                r = complete(url, model, s["full"], ex.max_new_tokens)
            r["score"] = score_prediction(r["text"], ex.answers, ex.metric)
            rows.append({"set": s["set"], "id": ex.id, **r})
        return rows

    def new_question(url: str, kind: str, reset: bool) -> list[dict]:
        """TTFT of a second question on each of the first ``--ttft-docs`` documents (decode s/token beside it)."""
        rows = []
        for s in stored[: args.ttft_docs]:
            if reset:
                reset_prefix_cache(url)
            if kind == "documents":
                r = complete(url, model, s["match"].prompt_ids, args.decode_tokens, s["doc"].params(), True)
            else:
                if not reset:  # in vLLM's prefix cache right now (the quality pass's later prompts evicted it)
                    complete(url, model, s["full"], 1)
                r = complete(url, model, s["full"], args.decode_tokens, ignore_eos=True)
            rows.append(r)
        return rows

    def summary(rows: list[dict]) -> dict[str, Any]:
        med = sorted(r["ttft_s"] for r in rows)[len(rows) // 2]
        decode = sorted(r["decode_s_per_token"] for r in rows if r["decode_s_per_token"])
        return {
            "ttft_s": round(med, 3),
            "decode_s_per_token": round(decode[len(decode) // 2], 4) if decode else None,
            "kv_slots": rows[0]["prompt_tokens"] + rows[0]["completion_tokens"],
            "cached_tokens": rows[0]["cached_tokens"],
        }

    full_slots = len(stored[0]["full"]) + args.decode_tokens
    if args.only == "concurrency":  # a KV space that holds two full requests, not three
        emit({**base, **space_run(args, work, docs_url, stored)})
        out.close()
        return
    if args.only == "blocks":  # the kvtc prefix blocks alone, against the same server's own full prefills
        _calibrate(kvtc_url, args.model)
        server = start("vllm-kvforge-kvtc", args, work / "logs", kvtc_url, quant=args.block_quant)
        try:
            name = f"vllm + kvforge {args.block_quant} blocks"
            emit(_prefix_blocks(server.url, name, kvtc_url, args, config, base, None, stored))
        finally:
            server.stop()
        out.close()
        return
    if args.only in ("documents", "ttft"):  # one server: full prefills and compressed documents, timed alternately
        server = start("vllm-kvforge", args, work / "logs", docs_url)
        try:
            if args.only == "documents":
                reference = quality(server.url, "full")
                compressed = quality(server.url, "documents")
                emit({**base, **documents_row(reference, compressed, stored, full_slots)})
            emit({**base, **alternating(server.url, args, stored)})
        finally:
            server.stop()
        out.close()
        return
    # 1. vLLM alone: quality reference (its own full prefill), prefix-cache hit TTFT
    server = start("vllm", args, work / "logs", None)
    try:
        reference = quality(server.url, "full")
        hit = new_question(server.url, "full", reset=False)  # the documents are in its prefix cache now
        emit(
            {
                **base,
                "config": "vllm alone (prefix cache)",
                "stored_bytes_per_doc": 0,
                **summary(hit),
                "score": sum(r["score"] for r in reference),
                "full_score": sum(r["score"] for r in reference),
            }
        )
    finally:
        server.stop()
    # 2. vLLM + kvforge: compressed documents, and full fp32 blocks on the same server
    server = start("vllm-kvforge", args, work / "logs", docs_url)
    try:
        compressed = quality(server.url, "documents")
        cold_doc = new_question(server.url, "documents", reset=True)  # from the store, vLLM's memory emptied
        warm_doc = new_question(server.url, "documents", reset=False)  # the placeholder's blocks in vLLM's cache
        row = documents_row(reference, compressed, stored, full_slots)
        emit({**base, **row, **summary(cold_doc), "ttft_s_warm": summary(warm_doc)["ttft_s"]})
        blocks = _prefix_blocks(
            server.url, "vllm + kvforge full blocks", docs_url, args, config, base, reference, stored
        )
        if blocks:
            emit(blocks)
    finally:
        server.stop()
    # 3. vLLM + kvforge kvtc prefix blocks, coded with the model's calibrated basis (as kvforge's engine codes)
    _calibrate(kvtc_url, args.model)
    server = start("vllm-kvforge-kvtc", args, work / "logs", kvtc_url, quant=args.block_quant)
    try:
        emit(
            _prefix_blocks(
                server.url, f"vllm + kvforge {args.block_quant} blocks", kvtc_url, args, config, base, reference, stored
            )
        )
    finally:
        server.stop()
    if args.lmcache_python:
        emit({**base, **lmcache_probe(args, work)})
    if args.concurrency_docs:
        emit({**base, **space_run(args, work, docs_url, stored)})
    out.close()


LMCACHE_PROBE = """
import os, sys
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", LMCACHE_LOCAL_CPU="True",
                  LMCACHE_CHUNK_SIZE="256", LMCACHE_MAX_LOCAL_CPU_SIZE="1")
import lmcache, vllm
from importlib.metadata import version
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=2048,
          kv_transfer_config={"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
prompt = [{"prompt_token_ids": [int(t) for t in sys.argv[2].split(",")]}]
for _ in range(2):
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    llm.reset_prefix_cache()
print("LMCACHE", version("lmcache"), vllm.__version__, out[0].num_cached_tokens, flush=True)
"""


def lmcache_probe(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Whether vLLM + LMCache's CPU path reuses a prompt here: a prompt asked twice (vLLM's own cache emptied
    between); the reason in one line when it does not."""
    import subprocess

    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(args.model)(TEXT_SAMPLE * 40).input_ids[:1000]
    done = subprocess.run([args.lmcache_python, "-c", LMCACHE_PROBE, args.model, ",".join(map(str, ids))],
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    found = re.search(r"^LMCACHE (\S+) (\S+) (\d+)$", done.stdout, re.M)
    errors = re.findall(r"^[\w.]*(?:Error|Exception): .*$", done.stdout + done.stderr, re.M)
    cached = int(found.group(3)) if found else 0
    reason = None if cached else (errors[0] if errors else f"exit {done.returncode}, nothing reused")
    return {
        "config": "vllm + lmcache",
        "lmcache": found.group(1) if found else None,
        "vllm": found.group(2) if found else None,
        "cached_tokens_on_repeat": cached,
        "reason": reason,
    }


def documents_row(reference: list[dict], compressed: list[dict], stored: list[dict], full_slots: int) -> dict:
    """Normalised score of the compressed documents against vLLM's own full prefill of the same token ids (rows
    paired by position: an id repeats across seeds)."""
    pairs = list(zip(compressed, reference, strict=True))
    score, full_score = sum(r["score"] for r in compressed), sum(r["score"] for r in reference)
    return {
        "config": "vllm + kvforge compressed documents (quality)",
        "score": score,
        "full_score": full_score,
        "normalised": round(100 * score / max(full_score, 1e-9), 1),
        "loaded": sum(r["loaded"] for r in compressed),
        "kv_slots": compressed[0]["prompt_tokens"] + compressed[0]["completion_tokens"],
        "full_kv_slots": reference[0]["prompt_tokens"] + reference[0]["completion_tokens"],
        "stored_bytes_per_doc": sum(s["bytes"] for s in stored) / len(stored),
        "fp16_bytes_per_doc": sum(s["fp16"] for s in stored) / len(stored),
        "by_set": {
            name: [
                sum(r["score"] for r in compressed if r["set"] == name),
                sum(f["score"] for r, f in pairs if r["set"] == name),
            ]
            for name in sorted({r["set"] for r in compressed})
        },
        "rows": [
            {
                "set": r["set"],
                "id": r["id"],
                "text": r["text"],
                "score": r["score"],
                "loaded": r["loaded"],
                "full_text": f["text"],
            }
            for r, f in pairs
        ],
    }


def alternating(url: str, args: argparse.Namespace, stored: list[dict]) -> dict[str, Any]:
    """TTFT of a new question on a stored document, alternating on one server: vLLM's own prefix-cache hit on the
    full document, then the compressed document loaded from the store (vLLM's memory of it emptied first), then the
    compressed document again (its placeholder's blocks now in vLLM's prefix cache); decode s/token of each."""
    rows: dict[str, list[dict]] = {"prefix_hit": [], "compressed_from_store": [], "compressed_in_memory": []}
    for s in stored[: args.ttft_docs]:
        complete(url, args.model, s["full"], 1)  # the full document now in vLLM's prefix cache
        rows["prefix_hit"].append(complete(url, args.model, s["full"], args.decode_tokens, ignore_eos=True))
        reset_prefix_cache(url)
        for name in ("compressed_from_store", "compressed_in_memory"):
            r = complete(url, args.model, s["match"].prompt_ids, args.decode_tokens, s["doc"].params(), True)
            rows[name].append(r)
    out: dict[str, Any] = {"config": "ttft, alternating on one server", "documents": len(rows["prefix_hit"])}
    for name, got in rows.items():
        out[name] = {
            "ttft_s": [round(r["ttft_s"], 3) for r in got],
            "decode_s_per_token": [round(r["decode_s_per_token"] or 0, 4) for r in got],
            "kv_slots": got[0]["prompt_tokens"] + got[0]["completion_tokens"],
            "cached_tokens": [r["cached_tokens"] for r in got],
        }
    return out


def space_run(args: argparse.Namespace, work: Path, url: str, stored: list[dict]) -> dict[str, Any]:
    """vLLM with exactly ``N`` KV blocks, ``N`` chosen to hold two full requests (document, question, answer) and
    not three; ``--concurrency-docs`` questions on distinct stored compressed documents sent at once, then as many
    full prompts: how many ran together and how many preemptions vLLM needed."""
    block = 128
    full = max(len(s["full"]) for s in stored) + args.decode_tokens
    small = max(len(s["match"].prompt_ids) for s in stored) + args.decode_tokens
    f, c = -(-full // block), -(-small // block)
    blocks = args.kv_blocks or max(2 * f, args.concurrency_docs * c)
    if blocks >= 3 * f or blocks < 2 * f:
        raise SystemExit(f"a KV space of {blocks} blocks does not hold exactly two full requests of {f} blocks")
    server = vllm_server("vllm-kvforge-space", args.port, args.model, work / "logs", url)
    server.command += ["--num-gpu-blocks-override", str(blocks), "--max-model-len", str(blocks * block // 2)] + (
        ["--enforce-eager"] if args.enforce_eager else []
    )
    server.start().wait()
    chosen = stored[: args.concurrency_docs]
    try:
        compressed = at_once(server.url, args.model, [(s["match"].prompt_ids, s["doc"].params()) for s in chosen],
                             args.decode_tokens)  # fmt: skip
        whole = at_once(server.url, args.model, [(s["full"], None) for s in chosen], args.decode_tokens)
    finally:
        server.stop()
    return {"config": "concurrency in a fixed KV space", "kv_blocks": blocks, "block_tokens": block,
            "blocks_per_full_request": f, "blocks_per_compressed_request": c, "compressed": compressed,
            "full": whole}  # fmt: skip


def _calibrate(store_url: str, model: str) -> None:
    """The model's kvtc basis named in the store (`kvforge cache calibrate`): what kvforge's engine codes with."""
    subprocess.run([sys.executable, "-m", "kvforge", "cache", "calibrate", "--store", store_url, "--model", model,
                    "--device", "cpu"], check=True)  # fmt: skip


def answer_line(text: str) -> str:
    """The answer in a greedy text: its first non-empty line (a needle's value, before the model runs on into a
    story of its own up to max_tokens)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _blocks_written(folder: Path, expected: int, timeout_s: float = 600) -> int:
    """Wait until the connector's background writer has stored ``expected`` block files (kvtc codes each block
    before writing it: seconds per block on a busy CPU); the count."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = len(list(folder.glob("segments/*/prefix-v2-*.kvseg")))
        if count >= expected or time.monotonic() > deadline:
            return count
        time.sleep(0.5)


def _prefix_blocks(
    url: str,
    name: str,
    store_url: str,
    args: argparse.Namespace,
    config: Any,
    base: dict,
    reference: list[dict] | None,
    stored: list[dict],
) -> dict:
    """Each full prompt once (its blocks stored), vLLM's memory emptied, then again: loaded from the store; compared
    with ``reference`` (vLLM alone), or with the first answer of the same server."""
    rows, expected = [], 0
    for s, ref in zip(stored, reference or [None] * len(stored), strict=True):
        first = complete(url, args.model_name, s["full"], s["ex"].max_new_tokens)
        reset_prefix_cache(url)
        expected += len(s["full"]) // STORE_BLOCK  # written from a background thread (kvtc: coded first)
        _blocks_written(Path(store_url.removeprefix("file://")), expected)
        again = complete(url, args.model_name, s["full"], s["ex"].max_new_tokens)
        if ref is None:  # no separate reference server: the same server's own full prefill
            ref = {"text": first["text"], "score": score_prediction(first["text"], s["ex"].answers, s["ex"].metric)}
        rows.append(
            {
                "id": s["ex"].id,
                "same": again["text"] == ref["text"],
                "same_answer": answer_line(again["text"]) == answer_line(ref["text"]),
                "texts": [ref["text"], again["text"]],
                "full_score": ref["score"],
                "first": first,
                "again": again,
                "score": score_prediction(again["text"], s["ex"].answers, s["ex"].metric),
            }
        )
    folder = Path(store_url.removeprefix("file://"))
    block_bytes = sum(f.stat().st_size for f in folder.glob("segments/*/prefix-v2-*.kvseg"))
    tokens = sum(len(s["full"]) // STORE_BLOCK * STORE_BLOCK for s in stored)
    ttft = sorted(r["again"]["ttft_s"] for r in rows)
    return {
        **base,
        "config": name,
        "stored_bytes_per_doc": block_bytes / len(stored),
        "stored_fraction_of_fp16": round(block_bytes / fp16_bytes(tokens, config), 4),
        "stored_tokens": tokens,
        "ttft_s": round(ttft[len(ttft) // 2], 3),
        "cached_tokens": rows[0]["again"]["cached_tokens"],
        "kv_slots": rows[0]["again"]["prompt_tokens"],
        "same_greedy": sum(r["same"] for r in rows),
        "same_answer": sum(r["same_answer"] for r in rows),
        "texts": {r["id"]: r["texts"] for r in rows},
        "score": sum(r["score"] for r in rows),
        "full_score": sum(r["full_score"] for r in rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the model folder vLLM serves (fp32 safetensors)")
    p.add_argument("--data-dir", help="the evaluation data folder (needle haystacks)")
    p.add_argument(
        "--set",
        action="append",
        default=None,
        help="NAME=TASK:SEEDS[:HAYSTACK,...], e.g. ruler=needle:4,5 (repeatable)",
    )
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    p.add_argument("--limit", type=int, default=None, help="at most this many examples (smoke runs)")
    p.add_argument("--press", default="kvzip:pool=3")
    p.add_argument("--compression-ratio", type=float, default=0.75)
    p.add_argument("--quant", default="kvtc-b2.2", help="how compressed documents are stored")
    p.add_argument("--block-quant", default="kvtc-b2.2", help="how the kvtc configuration stores prefix blocks")
    p.add_argument("--ttft-docs", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--concurrency-docs", type=int, default=8, help="0: skip the concurrency run")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="the concurrency run's KV space in blocks (default: the larger of two full requests and the "
                   "compressed ones; refused if it holds three full requests)")  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--only",
        choices=["documents", "ttft", "concurrency", "blocks"],
        default=None,
        help="documents: one server, compressed documents' quality and TTFT against the prefix-cache hit; ttft: the "
        "TTFT alone, on the first --ttft-docs documents",
    )
    p.add_argument("--compress-threads", type=int, default=None, help="torch threads of the compressing engine")
    p.add_argument(
        "--work",
        default=None,
        help="folder of the stores and logs (default: a new temporary one); "
        "documents already stored there are not compressed again",
    )
    p.add_argument("--lmcache-python", default=None, help="python of an environment with vLLM + lmcache (probe)")
    p.add_argument("--port", type=int, default=8311)
    p.add_argument("--out", default=str(RESULTS / "vllm" / "documents.jsonl"))
    p.add_argument("--report", default=None, help="print the table of a results file instead of running")
    p.add_argument("--plot", default=None, help="with --report: draw its configurations into this PNG")
    args = p.parse_args()
    if args.report:
        report(args.report, args.plot)
        return
    args.set = args.set or ["ruler=needle:4,5", "narrative=needle-narrative:2,3:haystack_gutenberg/books.jsonl"]
    args.model_name = args.model
    run(args)


def report(path: str, plot: str | None = None) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if plot:
        draw(rows, plot)
    print("| configuration | stored bytes / document | TTFT s, new question | decode s/token | KV slots | score |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        score = r.get("normalised")
        score = f"{score} normalised" if score is not None else f"{r.get('score')} of {r.get('full_score')}"
        print(
            f"| {r['config']} | {r.get('stored_bytes_per_doc', 0) / 1e6:.2f} MB | {r.get('ttft_s')} | "
            f"{r.get('decode_s_per_token')} | {r.get('kv_slots')} | {score} |"
        )


def draw(rows: list[dict], path: str) -> None:
    """Per configuration (rows not marked ``superseded``): stored bytes per document, KV slots of a question and
    the score against vLLM's own full prefill; times stay in the table (they need a quiet machine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = [r for r in rows if "superseded" not in r and "stored_bytes_per_doc" in r and r.get("kv_slots")]
    kept = [r for r in kept if r["config"] != "vllm + kvforge compressed documents" or "normalised" in r]
    label = lambda r: r["config"].removeprefix("vllm + kvforge ").replace(" (prefix cache)", "").replace(  # noqa: E731
        " (quality)", "")
    kept = list({label(r): r for r in kept}.values())  # the latest row of each configuration
    names = [label(r) for r in kept]
    scores = [r.get("normalised", 100 * r.get("score", 0) / max(r.get("full_score") or 1, 1e-9)) for r in kept]
    panels = [("stored MB per document", [r["stored_bytes_per_doc"] / 1e6 for r in kept]),
              ("KV slots of a question", [r["kv_slots"] for r in kept]),
              ("score, normalised to vLLM's full prefill", scores)]  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.2))
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.barh(names, values, color="#4a78b0")
        ax.set_title(title, fontsize=10)
        ax.invert_yaxis()
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,.0f}" if v >= 100 else f" {v:.3g}", va="center", fontsize=8)
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle("vLLM (CPU build) with and without kvforge: same weights, same needle questions", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[bench] plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
