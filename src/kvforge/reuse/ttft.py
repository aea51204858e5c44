"""TTFT with and without prefix reuse, per store tier (``kvforge bench reuse``, benchmarks/reuse_ttft.py)."""

from __future__ import annotations

import logging
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvforge.paths import default_data_dir, haystack_files
from kvforge.reuse.prefix import PrefixReuse

logger = logging.getLogger(__name__)


def haystack_ids(tokenizer: Any, num_tokens: int, data_dir: Path | None = None) -> list[int]:
    """``num_tokens`` token ids of the haystack (RULER's Paul Graham essays when the shared data is there, else the
    public-domain excerpt bundled with kvforge), repeated if needed."""
    from kvforge.eval.tasks.needle import read_haystack

    files = haystack_files(data_dir or default_data_dir())
    text = read_haystack(tuple(files))[: num_tokens * 6]
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    if not ids:
        raise ValueError(f"no text in {', '.join(map(str, files))}")
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


@torch.inference_mode()
def measure_reuse_ttft(
    engine: Any,
    store_urls: Sequence[str],
    lengths: Sequence[int],
    *,
    repeats: int = 3,
    block_size: int = 256,
    data_dir: Path | None = None,
) -> Iterator[dict[str, Any]]:
    """One row per (length, store): cold TTFT (miss lookup + full prefill), warm TTFT (load + last token).

    The cold prefill is run once per length and shared by the tiers (it does not touch the store); each tier adds
    its own miss lookup. The warm run reopens the store (file/redis: a fresh index, as another process would) and
    takes the median of ``repeats``. Keys live in a per-run namespace and are deleted afterwards.
    """
    from kvforge.store import open_store

    run_id = f"{engine.model_id}-bench-{uuid.uuid4().hex[:8]}"
    for length in lengths:
        ids = haystack_ids(engine.tokenizer, length, data_dir)
        engine.check_length(length)
        (cache, ref_logits), prefill_s = _timed(lambda ids=ids: engine.prefill(ids))
        for url in store_urls:
            store = open_store(url)
            reuse = PrefixReuse(store, run_id, block_size=block_size, device=engine.model.device)
            miss, miss_s = _timed(lambda reuse=reuse, ids=ids: reuse.plan(ids))
            assert miss.kind == "miss", "a benchmark run namespace is fresh: the first lookup must miss"
            _, record_s = _timed(lambda reuse=reuse, ids=ids, cache=cache: reuse.record(ids, cache))
            warm_store = store if url.startswith("memory://") else open_store(url)
            warm = PrefixReuse(warm_store, run_id, block_size=block_size, device=engine.model.device)
            times, load_times, diff = [], [], 0.0
            for _ in range(repeats):
                start = time.perf_counter()
                plan = warm.plan(ids)
                load_times.append(time.perf_counter() - start)
                _, logits = engine.prefill(plan.prefill_ids, plan.cache)
                int(logits.argmax(-1))  # the first token is picked: TTFT ends here
                times.append(time.perf_counter() - start)
                diff = max(diff, float((logits.float() - ref_logits.float()).abs().max()))
            cold = miss_s + prefill_s
            warm_s = statistics.median(times)
            yield {
                "bench": "reuse_ttft",
                "store": url,
                "prompt_tokens": length,
                "reused_tokens": plan.reused_tokens,
                "cold_ttft_s": round(cold, 4),
                "warm_ttft_s": round(warm_s, 4),
                "ttft_reduction": round(1 - warm_s / cold, 4),
                "load_s": round(statistics.median(load_times), 4),
                "record_s": round(record_s, 4),
                "stored_mib": round(sum(_stored_bytes(store, k) for k in warm.block_keys(ids)) / 2**20, 2),
                "max_abs_logit_diff": diff,
                "repeats": repeats,
                "block_size": block_size,
            }
            for key in reuse.block_keys(ids):
                store.delete(key)


def _stored_bytes(store: Any, key: str) -> int:
    size = getattr(store, "stored_size", None)
    value = size(key) if size is not None else None
    return int(value or 0)
