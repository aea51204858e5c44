"""Real-model check (marker ``slow``): lookahead scoring keeps a needle that window scoring loses.

Model from conftest's ``smollm2`` fixture (skipped when the bundled package is missing).
smollm2-135m, a ~2k-token natural-text haystack with "The secret code for the <key> is <7 digits>." at 10% depth,
query-aware (question inside the compressed prompt), 25% of the KV kept.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvforge.cache import KVCache
from kvforge.paths import default_data_dir
from kvforge.prefill import forward
from kvforge.presses import build_press, compress_prefill

pytestmark = pytest.mark.slow
KEYS = ["blue harbour", "old lighthouse", "silver gate", "north tower", "iron bridge", "red cellar", "glass garden"]


def needle_prompt(tokenizer, seed: int = 0, num_tokens: int = 1900, depth: float = 0.1) -> tuple[list[int], str]:
    books = default_data_dir() / "haystack_gutenberg" / "books.jsonl"
    if not books.exists():
        pytest.skip(f"haystack data not found at {books}")
    rng = random.Random(seed)
    text = json.loads(books.open().readline())["text"]
    start = text.index(". ", rng.randrange(0, len(text) - num_tokens * 8)) + 2
    key = rng.choice(KEYS)
    code = str(rng.randrange(1_000_000, 9_999_999))
    hay = tokenizer.decode(
        tokenizer.encode(text[start : start + num_tokens * 6], add_special_tokens=False)[:num_tokens]
    )
    cut = hay.find(". ", int(len(hay) * depth)) + 2
    context = hay[:cut] + f" The secret code for the {key} is {code}. " + hay[cut:]
    messages = [{"role": "user", "content": f"{context}\n\nWhat is the secret code for the {key}?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt + f"The secret code for the {key} is", add_special_tokens=False), code


@torch.inference_mode()
def answer(model, tokenizer, ids: list[int], press_name: str) -> str:
    cache = KVCache.for_model(model)
    logits = compress_prefill(model, torch.tensor([ids]), cache, build_press(press_name, 0.75), tokenizer=tokenizer)
    out = []
    for _ in range(9):
        out.append(int(logits.argmax(-1)))
        logits = forward(model, torch.tensor([[out[-1]]]), cache)[:, -1]
    return tokenizer.decode(out).replace(" ", "")


def test_lookahead_keeps_the_needle_at_25_percent(smollm2):
    model, tokenizer = smollm2
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    ids, code = needle_prompt(tokenizer)
    assert 1900 < len(ids) < 2100
    assert code == "8056020"  # same case as benchmarks/press_needle.py case 0
    assert code in answer(model, tokenizer, ids, "full")
    assert code in answer(model, tokenizer, ids, "snapkv-lookahead")
    assert code not in answer(model, tokenizer, ids, "snapkv")  # window scoring alone loses it on this model
