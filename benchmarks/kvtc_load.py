"""Load time of a document stored compressed for vLLM: the store read and decode (``KVStore.get``) and its keys moved
to their slots (``slot_kv``), as a vLLM connector does before a question on a document vLLM no longer holds.

A document of ``--tokens`` tokens of the bundled public-domain sample is compressed once by kvforge's engine
(``--press``, 25% kept per KV head, whole 128-slot blocks) and stored under ``--quant``; then, alternating, each step
is timed ``--repeats`` times (medians; the first read, from a cold store object, apart).

    PYTHONPATH=src python benchmarks/kvtc_load.py --threads 1 --repeats 9

One JSON line on stdout and appended to results/performance/kvtc_load.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from importlib import resources

import torch
from common import RESULTS, append_rows

from kvforge.model import model_folder
from kvforge.provenance import git_sha
from kvforge.rope import rope_spec
from kvforge.store import open_store
from kvforge.vllm import documents as docs
from kvforge.vllm.client import VllmDocuments


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--press", default="kvzip-plus")
    p.add_argument("--compression-ratio", type=float, default=0.75)
    p.add_argument("--quant", default="kvtc-b2.2")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    url = f"file://{tempfile.mkdtemp(prefix='kvforge-kvtc-load-')}"
    client = VllmDocuments.for_model(str(model_folder(args.model)), url, args.press, args.compression_ratio, args.quant)
    sample = resources.files("kvforge.data").joinpath("haystack_gutenberg/moby_dick_excerpt.txt").read_text()
    text = client.tokenizer.decode(client.tokenizer(sample)["input_ids"][: args.tokens])
    (doc,) = client.add([text])
    rope, key = rope_spec(client.engine.model), doc.key
    store = open_store(url)  # a new store object, as another process would open it
    t = time.perf_counter()
    first = store.get(key)
    cold = time.perf_counter() - t
    assert first is not None
    get_s, slot_s = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        segment = store.get(key)
        t1 = time.perf_counter()
        docs.slot_kv(segment, doc, rope, torch.float32)
        get_s.append(t1 - t)
        slot_s.append(time.perf_counter() - t1)
    row = {
        "bench": "kvtc_load",
        "git": git_sha(),
        "model": args.model,
        "press": args.press,
        "quant": args.quant,
        "tokens": doc.num_tokens,
        "slots": doc.num_slots,
        "stored_bytes": store.stored_size(key),
        "threads": args.threads,
        "first_get_s": round(cold, 4),
        "get_s": round(statistics.median(get_s), 4),
        "slot_kv_s": round(statistics.median(slot_s), 4),
    }
    print(json.dumps(row))
    append_rows(RESULTS / "performance" / "kvtc_load.jsonl", row)


if __name__ == "__main__":
    main()
