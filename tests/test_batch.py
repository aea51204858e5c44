"""Continuous batching gives every sequence exactly what it gets alone (mixed lengths, compressed, reused caches):
the packed forward itself, and the engine's steps that build it."""

from __future__ import annotations

import pytest
import torch

from kvforge.batch import forward_batch, forward_packed
from kvforge.cache import KVCache
from kvforge.decode import DecodeState, SamplingParams, decode
from kvforge.engine import Engine
from kvforge.prefill import prefill
from kvforge.presses import build_press, compress_prefill
from kvforge.request import Request
from kvforge.reuse.base import GivenCache
from kvforge.testing import tiny_model, tiny_tokenizer

ARCHS = ["gemma3", "llama", "qwen2"]
NEW_TOKENS = 12


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 99, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _caches(model, how: str, ids: list[int]) -> tuple[KVCache, torch.Tensor]:
    """A prefilled cache built ``how``: plain, compressed (head-wise AdaKV / SnapKV), or reused (stored prefix)."""
    cache = KVCache.for_model(model)
    x = torch.tensor([ids])
    if how == "plain":
        return cache, prefill(model, x, cache)
    if how in ("snapkv", "adakv"):
        press = build_press(how, compression_ratio=0.5, window_size=4)
        return cache, compress_prefill(model, x, cache, press)
    assert how == "reused"
    prefill(model, x[:, : len(ids) // 2], cache)
    reused = KVCache.from_segment(cache.to_segment(), model)  # as a store round trip gives it back
    return reused, prefill(model, x[:, len(ids) // 2 :], reused)


def _engine(model, **kwargs) -> Engine:
    engine = Engine(model, tiny_tokenizer(), **kwargs)
    engine.eos_token_ids = []  # every sequence runs to its own budget
    return engine


def _given(model, how: str, ids: list[int], max_new_tokens: int, **kwargs) -> Request:
    """A request whose prompt the caller prefilled already (its cache and last logits)."""
    cache, logits = _caches(model, how, ids)
    return Request(list(ids), max_new_tokens, reuse=GivenCache(cache, logits), **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decode_equals_alone(arch):
    model = tiny_model(arch)
    specs = [("plain", 5), ("plain", 40), ("snapkv", 33), ("adakv", 50), ("reused", 27), ("plain", 70)]
    alone, alone_logits = [], []
    for i, (how, n) in enumerate(specs):
        cache, logits = _caches(model, how, _ids(i, n))
        result = decode(model, cache, logits, NEW_TOKENS)
        alone.append(result.token_ids)
        alone_logits.append(cache)
    engine = _engine(model)
    seqs = [engine.add(_given(model, how, _ids(i, n), NEW_TOKENS)) for i, (how, n) in enumerate(specs)]
    gens = [engine.complete(s) for s in seqs]
    assert [g.token_ids for g in gens] == alone
    for seq, ref in zip(seqs, alone_logits, strict=True):  # same cache contents afterwards
        assert seq.cache.next_position == ref.next_position
        assert seq.cache.lengths() == ref.lengths()


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_join_and_leave_at_any_step(arch):
    """Sequences join mid-way and leave at their own budget; logits stay those of a lone decode."""
    model = tiny_model(arch)
    budgets = [3, 15, 7, 10]
    refs = []
    for i, n in enumerate(budgets):
        cache, logits = _caches(model, "plain", _ids(10 + i, 20 + 9 * i))
        refs.append(decode(model, cache, logits, n).token_ids)
    assert [len(r) for r in refs] == budgets  # no EOS in a tiny model: each runs to its own budget
    engine = _engine(model)
    waiting = [_given(model, "plain", _ids(10 + i, 20 + 9 * i), n) for i, n in enumerate(budgets)]
    seqs, step = [], 0
    while waiting or engine.has_work:
        if waiting and step % 3 == 1:
            seqs.append(engine.add(waiting.pop(0)))
        engine.step()
        step += 1
    assert [s.result().token_ids for s in seqs] == refs


def test_forward_batch_logits_match_single_forward():
    model = tiny_model("llama")
    caches, singles = [], []
    for i, n in enumerate([4, 31, 9]):
        a, _ = _caches(model, "plain", _ids(20 + i, n))
        b, _ = _caches(model, "plain", _ids(20 + i, n))
        caches.append(a)
        singles.append(b)
    batched = forward_batch(model, [5, 6, 7], caches)
    for i, cache in enumerate(singles):
        from kvforge.prefill import forward

        single = forward(model, [5 + i], cache)[:, -1]
        torch.testing.assert_close(batched[i : i + 1], single, rtol=1e-5, atol=1e-5)


def test_sampling_seed_and_stop_stay_per_sequence(tokenizer):
    model = tiny_model("qwen2")
    params = [SamplingParams(temperature=0.8, seed=7), SamplingParams(), SamplingParams(temperature=1.0, seed=3)]
    refs, requests = [], []
    for i, p in enumerate(params):
        cache, logits = _caches(model, "plain", _ids(30 + i, 16))
        refs.append(decode(model, cache, logits, DecodeState(10, p, stop=["a"], tokenizer=tokenizer)).token_ids)
        requests.append(_given(model, "plain", _ids(30 + i, 16), 10, sampling=p, stop=["a"]))
    engine = Engine(model, tokenizer)
    engine.eos_token_ids = []
    assert [g.token_ids for g in engine.run_many(requests)] == refs


def test_failed_forward_rolls_back_every_cache():
    model = tiny_model("llama")
    caches = [_caches(model, "plain", _ids(40 + i, 8 + i))[0] for i in range(2)]
    before = [(c.next_position, c.lengths()) for c in caches]
    with pytest.raises(ValueError):
        forward_batch(model, [1], caches)
    with pytest.raises(IndexError):
        forward_batch(model, [1, 10_000], caches)  # a token outside the vocabulary fails inside the forward
    assert [(c.next_position, c.lengths()) for c in caches] == before


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_forward_equals_each_chunk_alone(arch):
    """Prompt chunks of different lengths and single decode tokens in one packed forward: each row's logits and cache
    are those of its own forward (plain, compressed and reused caches)."""
    model = tiny_model(arch)
    specs = [("plain", 5, 1), ("snapkv", 33, 9), ("reused", 27, 1), ("plain", 40, 23), ("adakv", 50, 1)]
    packed, alone, rows, refs = [], [], [], []
    for i, (how, n, size) in enumerate(specs):
        packed.append(_caches(model, how, _ids(i, n))[0])
        cache = _caches(model, how, _ids(i, n))[0]
        rows.append(_ids(50 + i, size))
        refs.append(prefill(model, torch.tensor([rows[-1]]), cache, chunk_size=None))
        alone.append(cache)
    logits = forward_packed(model, rows, packed)
    assert logits.shape[0] == len(specs)
    for i, (cache, ref) in enumerate(zip(packed, refs, strict=True)):
        torch.testing.assert_close(logits[i : i + 1], ref, rtol=1e-5, atol=1e-5)
        assert cache.next_position == alone[i].next_position and cache.lengths() == alone[i].lengths()
        assert cache.token_ids == alone[i].token_ids


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_prompts_prefilled_in_chunks_beside_decoding_sequences_get_their_lone_tokens(arch):
    """Two sequences decode while two prompts are prefilled 7 tokens per step in the same forwards; then all four
    decode together. Every sequence gets exactly its lone greedy tokens."""
    model = tiny_model(arch)
    prompts = [_ids(60 + i, n) for i, n in enumerate([12, 30, 45, 19])]
    refs = []
    for ids in prompts:
        cache = KVCache.for_model(model)
        refs.append(decode(model, cache, prefill(model, torch.tensor([ids]), cache), NEW_TOKENS).token_ids)
    engine = _engine(model, prefill_budget=7)
    seqs = [engine.add(_given(model, "plain", ids, NEW_TOKENS)) for ids in prompts[:2]]
    seqs += [engine.add(Request(ids, NEW_TOKENS)) for ids in prompts[2:]]
    budgets: list[int] = []
    real = engine.schedule

    def spy(*args):
        chosen = real(*args)
        budgets.append(sum(n for _, n in chosen))
        return chosen

    engine.schedule = spy
    assert [engine.complete(s).token_ids for s in seqs] == refs
    assert max(budgets) == 7 and sum(budgets) == 45 + 19  # both prompts went through budgeted steps


def test_packed_forward_checks_its_input():
    model = tiny_model("llama")
    caches = [_caches(model, "plain", _ids(70 + i, 6))[0] for i in range(2)]
    with pytest.raises(ValueError, match="at least one token"):
        forward_packed(model, [[1, 2], []], caches)
    with pytest.raises(ValueError, match="twice"):
        forward_packed(model, [[1], [2]], [caches[0], caches[0]])
