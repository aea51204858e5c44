"""Exact prefix reuse on tiny models: logits equal a full prefill, keys are process-independent, LRU order."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from kvforge.cache import KVCache
from kvforge.prefill import prefill
from kvforge.reuse import PrefixReuse, ReusePlan, ReuseStrategy
from kvforge.testing import tiny_model
from kvforge.types import KVSegment, ReuseFacts

SRC = str(Path(__file__).resolve().parents[1] / "src")


class DictStore:
    """In-memory LRU store with the KVStore methods reuse uses (a fake: get/put refresh recency, touch too)."""

    def __init__(self, max_entries: int | None = None) -> None:
        self.data: OrderedDict[str, KVSegment] = OrderedDict()
        self.blobs: dict[str, bytes] = {}
        self.max_entries = max_entries
        self.evicted: list[str] = []
        self.num_gets = 0
        self.num_blob_puts = 0

    @staticmethod
    def check(key: str) -> str:
        assert re.fullmatch(r"[A-Za-z0-9._-]{1,200}", key), f"invalid store key {key!r}"  # as kvforge.store
        return key

    def get(self, key: str) -> KVSegment | None:
        self.num_gets += 1
        self.check(key)
        if key not in self.data:
            return None
        self.data.move_to_end(key)
        return copy.deepcopy(self.data[key])

    def put(self, key: str, segment: KVSegment) -> None:
        self.data[self.check(key)] = copy.deepcopy(segment)
        self.data.move_to_end(key)
        while self.max_entries is not None and len(self.data) > self.max_entries:
            self.evicted.append(self.data.popitem(last=False)[0])

    def touch(self, key: str) -> None:
        if key in self.data:
            self.data.move_to_end(key)

    def contains(self, key: str) -> bool:
        return key in self.data

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def keys(self) -> list[str]:
        return list(self.data)

    def put_blob(self, key: str, data: bytes) -> None:
        self.blobs[self.check(key)] = bytes(data)
        self.num_blob_puts += 1

    def get_blob(self, key: str) -> bytes | None:
        return self.blobs.get(key)

    def delete_blob(self, key: str) -> None:
        self.blobs.pop(key, None)

    def blob_keys(self) -> list[str]:
        return list(self.blobs)


def ids_of(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 99, (n,), generator=g).tolist()


def full_prefill(model, ids, chunk_size=None, block_size=256):
    cache = KVCache.for_model(model, block_size=block_size)
    logits = prefill(model, ids, cache, chunk_size=chunk_size)
    return cache, logits


def reuse_prefill(model, reuse, ids):
    plan = reuse.plan(ids)
    cache = plan.cache if plan.cache is not None else KVCache.for_model(model)
    logits = prefill(model, plan.prefill_ids, cache)
    return plan, cache, logits


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "gemma3"])
def model(request):
    return tiny_model(request.param)


def test_protocol_and_plan_validation():
    assert isinstance(PrefixReuse(DictStore(), "m"), ReuseStrategy)
    with pytest.raises(ValueError, match="at least one token"):
        ReusePlan(cache=None, reused_tokens=0, prefill_ids=[])
    with pytest.raises(ValueError, match="block_size"):
        PrefixReuse(DictStore(), "m", block_size=0)
    with pytest.raises(ValueError, match="model_id"):
        PrefixReuse(DictStore(), "")


def test_miss_on_empty_store():
    plan = PrefixReuse(DictStore(), "m", block_size=8).plan(ids_of(20))
    assert plan.kind == "miss" and plan.cache is None and plan.reused_tokens == 0 and len(plan.prefill_ids) == 20


@pytest.mark.parametrize("num_shared", [50, 37, 33, 32, 31, 17, 16, 15, 5, 1])
def test_prefix_reuse_gives_full_prefill_logits(model, num_shared):
    """Record a 50-token prompt, then ask a prompt sharing its first ``num_shared`` tokens: reused to the last one."""
    reuse = PrefixReuse(DictStore(), "tiny", block_size=16)
    first = ids_of(50, seed=1)
    cache, _ = full_prefill(model, first)
    reuse.record(first, cache)
    second = first[:num_shared] + ids_of(60 - num_shared, seed=2) if num_shared < 50 else first
    plan, cache2, logits = reuse_prefill(model, reuse, second)
    assert common_prefix(first, second) >= num_shared
    assert plan.reused_tokens == min(common_prefix(first, second), len(second) - 1)
    assert plan.kind == "prefix"
    assert plan.token_ids == second
    _, ref = full_prefill(model, second)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    assert cache2.next_position == len(second) and cache2.token_ids == second


def test_reuse_at_every_token_boundary(model):
    """Whatever token the prompts diverge at (inside a block, on a block end, in the root block), the reused prefix
    ends there and the logits are those of a full prefill."""
    reuse = PrefixReuse(DictStore(), "tiny", block_size=8)
    first = ids_of(40, seed=21)
    cache, _ = full_prefill(model, first)
    reuse.record(first, cache)
    for split in range(1, 41):
        tail = [t if t != first[split] else t % 90 + 4 for t in ids_of(7, seed=split)] if split < 40 else [5]
        second = first[:split] + tail
        assert common_prefix(first, second) == split
        plan, _, logits = reuse_prefill(model, reuse, second)
        assert plan.reused_tokens == split, split
        _, ref = full_prefill(model, second)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_full_hit_block_aligned_recomputes_last_token(model):
    reuse = PrefixReuse(DictStore(), "tiny", block_size=16)
    ids = ids_of(48, seed=3)
    cache, ref = full_prefill(model, ids)
    reuse.record(ids, cache)
    plan, _, logits = reuse_prefill(model, reuse, ids)
    assert plan.reused_tokens == 47 and plan.prefill_ids == ids[-1:]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_window_layers_that_dropped_entries_still_give_exact_logits():
    """Gemma3 sliding layers (window 16) compact old entries during a chunked prefill: a prefix end is reused only
    where those layers still hold the window before it, and reuse stays exact at any such token."""
    model = tiny_model("gemma3")
    reuse = PrefixReuse(DictStore(), "tiny", block_size=8)
    ids = ids_of(64, seed=4)
    cache, _ = full_prefill(model, ids, chunk_size=8, block_size=8)
    assert min(cache.lengths()) < 64  # the sliding layers did drop entries
    oldest = max(int(layer.view()[2][0, 0].min()) for layer in cache.layers)  # oldest entry the sliding layers hold
    reuse.record(ids, cache)
    window = 16
    reused = []
    for n in (64, 61, 57, 56, 50, 45, 40):
        query = ids[:n] + [t if t != [*ids, 0][n] else t % 90 + 4 for t in ids_of(10, seed=5)]
        plan, _, logits = reuse_prefill(model, reuse, query)
        assert plan.reused_tokens == (n if n - window + 1 >= oldest else 0), n
        reused.append(plan.reused_tokens)
        _, ref = full_prefill(model, query)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    assert 61 in reused and 0 in reused  # reused inside a block, refused where the window was dropped


def test_foreign_or_compressed_cache_is_not_recorded(model):
    store = DictStore()
    reuse = PrefixReuse(store, "tiny", block_size=16)
    ids = ids_of(40, seed=6)
    cache, _ = full_prefill(model, ids)
    reuse.record(ids_of(40, seed=7), cache)  # tokens differ from the cache's
    assert not store.data
    cache.reuse = ReuseFacts("semantic", 40, approximate=True)
    reuse.record(ids, cache)
    assert not store.data
    cache.reuse = None
    layer = cache.layers[-1]
    k, v, p, _ = layer.view()
    layer.replace(k[:, :, ::2], v[:, :, ::2], p[:, :, ::2])  # a "press" kept every other token
    reuse.record(ids, cache)
    assert not store.data


def test_corrupt_block_is_a_miss(model):
    store = DictStore()
    reuse = PrefixReuse(store, "tiny", block_size=16)
    ids = ids_of(40, seed=8)
    cache, _ = full_prefill(model, ids)
    reuse.record(ids, cache)
    second_key = reuse.block_keys(ids)[1]
    store.data[second_key].token_ids[0] += 1  # not the tokens the key names
    plan = reuse.plan(ids)
    assert plan.reused_tokens == 16


def test_keys_chain_and_namespace():
    reuse = PrefixReuse(DictStore(), "model-a", block_size=4)
    ids = list(range(3, 13))
    keys = reuse.block_keys(ids)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert reuse.block_keys(ids[:8]) == keys[:2]
    assert reuse.block_keys([4, *ids[1:]])[1] != keys[1]  # a changed early token changes every later key
    assert PrefixReuse(DictStore(), "model-b", block_size=4).block_keys(ids) != keys
    assert PrefixReuse(DictStore(), "model-a", block_size=5).block_keys(ids)[0] != keys[0]


def test_keys_identical_across_processes():
    ids = list(range(3, 700, 7))
    code = (
        "from kvforge.reuse.prefix import PrefixReuse\n"
        f"print(','.join(PrefixReuse(None, 'fp', block_size=16).block_keys({ids!r})))"
    )
    env = dict(os.environ, PYTHONPATH=SRC, PYTHONHASHSEED="12345")  # another string-hash seed than this process
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().split(",") == PrefixReuse(None, "fp", block_size=16).block_keys(ids)


def test_suffix_blocks_evicted_before_prefixes(model):
    """LRU bounded at 6 entries: after reusing prompt A's prefix and recording B, only suffix blocks went."""
    store = DictStore(max_entries=6)
    reuse = PrefixReuse(store, "tiny", block_size=8)
    a = ids_of(32, seed=9)  # 4 blocks
    cache, _ = full_prefill(model, a)
    reuse.record(a, cache)
    b = a[:16] + ids_of(24, seed=10)  # shares 2 blocks, 3 new ones
    plan, cache_b, _ = reuse_prefill(model, reuse, b)
    assert plan.reused_tokens == 16
    reuse.record(b, cache_b)
    keys_a, keys_b = reuse.block_keys(a), reuse.block_keys(b)
    assert set(store.evicted) == {keys_a[3]}  # A's last block, not the shared prefix
    assert all(store.contains(k) for k in keys_b) and store.contains(keys_a[2])
    order = list(store.data)
    assert order.index(keys_b[0]) > order.index(keys_b[1]) > order.index(keys_b[-1])


def test_restart_keeps_hits_with_file_store(tmp_path, model):
    store_mod = pytest.importorskip("kvforge.store")
    url = f"file://{tmp_path}/kv"
    ids = ids_of(40, seed=11)
    cache, ref = full_prefill(model, ids)
    PrefixReuse(store_mod.open_store(url), "tiny", block_size=16).record(ids, cache)
    reopened = PrefixReuse(store_mod.open_store(url), "tiny", block_size=16)
    plan, _, logits = reuse_prefill(model, reopened, ids)
    assert plan.reused_tokens == 39
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def stored_tokens(store: DictStore) -> int:
    return sum(seg.num_tokens for seg in store.data.values())


def test_tail_is_stored_once_and_dropped_when_a_prompt_extends_it(model):
    """A document alone ends in a partial tail; a question on it reuses the tail, and once the question's block
    (tail + question) is stored and listed, the tail is deleted: every token's KV is stored once."""
    store = DictStore()
    reuse = PrefixReuse(store, "tiny", block_size=16)
    doc, q1, q2 = ids_of(40, seed=40), ids_of(20, seed=41), ids_of(12, seed=42)
    q2[0] = q1[0] % 90 + 4  # the questions differ from their first token
    cache, _ = full_prefill(model, doc)
    reuse.record(doc, cache)
    tail_key = reuse.block_keys(doc)[-1]
    assert stored_tokens(store) == 40 and tail_key in store.data

    plan, cache1, logits = reuse_prefill(model, reuse, doc + q1)
    assert plan.reused_tokens == 40 and plan.info["branch_tokens"] == 8
    reuse.record(doc + q1, cache1)
    assert tail_key not in store.data and stored_tokens(store) == 60  # the tail's KV now lives in one block only

    for query, expected in ((doc + q2, 40), (doc, 39), (doc[:35], 34)):
        plan, cache2, logits = reuse_prefill(model, reuse, query)
        assert plan.reused_tokens == expected
        _, ref = full_prefill(model, query)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    before = set(store.data)
    reuse.record(doc[:35], cache2)  # its tail is the head of a stored block: not stored again
    assert set(store.data) == before


def test_prompts_sharing_less_than_a_block(model):
    """Two chats with the same short system prompt share no whole block: the second reuses the system prompt."""
    reuse = PrefixReuse(DictStore(), "tiny", block_size=32)
    system = ids_of(11, seed=43)
    first, second = system + ids_of(50, seed=44), system + ids_of(30, seed=45)
    second[11] = first[11] % 90 + 4
    cache, _ = full_prefill(model, first)
    reuse.record(first, cache)
    plan, _, logits = reuse_prefill(model, reuse, second)
    assert plan.reused_tokens == 11
    _, ref = full_prefill(model, second)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_best_branch_among_several_children(model):
    """A block with several stored children: the one sharing the most tokens is used (not only the first one)."""
    store = DictStore()
    reuse = PrefixReuse(store, "tiny", block_size=16)
    head = ids_of(16, seed=46)
    children = [ids_of(16, seed=47 + i) for i in range(4)]
    for child in children:
        child[0] = 5  # all children share their first token
        ids = head + child + ids_of(3, seed=60)
        cache, _ = full_prefill(model, ids)
        reuse.record(ids, cache)
    query = head + children[2][:9] + [children[2][9] % 90 + 4] + ids_of(6, seed=61)
    plan, _, logits = reuse_prefill(model, reuse, query)
    assert plan.reused_tokens == 16 + 9
    _, ref = full_prefill(model, query)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    assert len(store.blobs) == 2  # the root's list and the head block's (children after the first)


def test_prune_removes_lists_of_evicted_blocks(model):
    store = DictStore()
    reuse = PrefixReuse(store, "tiny", block_size=8)
    a = ids_of(20, seed=62)
    b = a[:8] + ids_of(12, seed=63)
    for ids in (a, b):
        cache, _ = full_prefill(model, ids)
        reuse.record(ids, cache)
    lists = [k for k in store.blobs if k.startswith("prefix-v2-branches-")]
    assert len(lists) == 1
    assert reuse.prune() == 0
    store.delete(reuse.block_keys(a)[0])  # evicted
    assert reuse.prune() == 1 and not [k for k in store.blobs if k.startswith("prefix-v2-branches-")]
