"""Continuous batching gives every sequence exactly what it gets alone (mixed lengths, compressed, reused caches)."""

from __future__ import annotations

import pytest
import torch

from kvforge.batch import Sequence, decode_step, forward_batch, forward_packed, mixed_step
from kvforge.cache import KVCache
from kvforge.decode import DecodeState, SamplingParams, decode
from kvforge.prefill import prefill
from kvforge.presses import build_press, compress_prefill
from kvforge.testing import tiny_model

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
    seqs = []
    for i, (how, n) in enumerate(specs):
        cache, logits = _caches(model, how, _ids(i, n))
        seqs.append(Sequence(cache, logits, DecodeState(NEW_TOKENS), tag=i))
    running = list(seqs)
    while running:
        running = decode_step(model, running)
    assert [s.state.tokens for s in seqs] == alone
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
    seqs = []
    for i, n in enumerate(budgets):
        cache, logits = _caches(model, "plain", _ids(10 + i, 20 + 9 * i))
        seqs.append(Sequence(cache, logits, DecodeState(n)))
    running, waiting = [], list(seqs)
    step = 0
    while waiting or running:
        if waiting and step % 3 == 1:
            running.append(waiting.pop(0))
        running = decode_step(model, running)
        step += 1
    assert [s.state.tokens for s in seqs] == refs


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
    refs, seqs = [], []
    for i, p in enumerate(params):
        cache, logits = _caches(model, "plain", _ids(30 + i, 16))
        refs.append(decode(model, cache, logits, 10, sampling=p, stop=["a"], tokenizer=tokenizer).token_ids)
        cache, logits = _caches(model, "plain", _ids(30 + i, 16))
        seqs.append(Sequence(cache, logits, DecodeState(10, p, stop=["a"], tokenizer=tokenizer)))
    running = list(seqs)
    while running:
        running = decode_step(model, running)
    assert [s.state.tokens for s in seqs] == refs


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
    """mixed_step: two sequences decode while two prompts are prefilled in chunks of 7 in the same forwards; then all
    four decode together. Every sequence gets exactly its lone greedy tokens."""
    model = tiny_model(arch)
    prompts = [_ids(60 + i, n) for i, n in enumerate([12, 30, 45, 19])]
    refs = []
    for ids in prompts:
        cache = KVCache.for_model(model)
        refs.append(decode(model, cache, prefill(model, torch.tensor([ids]), cache), NEW_TOKENS).token_ids)
    running = []
    for ids in prompts[:2]:
        cache = KVCache.for_model(model)
        running.append(Sequence(cache, prefill(model, torch.tensor([ids]), cache), DecodeState(NEW_TOKENS)))
    seqs = list(running)
    pending = [(ids, KVCache.for_model(model), 0) for ids in prompts[2:]]
    order = {id(cache): 2 + i for i, (_, cache, _) in enumerate(pending)} | {id(s.cache): i for i, s in enumerate(seqs)}
    while pending:
        chunks = [(ids[done : done + 7], cache) for ids, cache, done in pending]
        running, logits = mixed_step(model, running, chunks)
        still = []
        for (ids, cache, done), row in zip(pending, logits, strict=True):
            if done + 7 >= len(ids):
                seqs.append(Sequence(cache, row, DecodeState(NEW_TOKENS)))
                running.append(seqs[-1])
            else:
                still.append((ids, cache, done + 7))
        pending = still
    while running:
        running = decode_step(model, running)
    assert [s.state.tokens for s in sorted(seqs, key=lambda s: order[id(s.cache)])] == refs


def test_packed_forward_checks_its_input():
    model = tiny_model("llama")
    caches = [_caches(model, "plain", _ids(70 + i, 6))[0] for i in range(2)]
    with pytest.raises(ValueError, match="at least one token"):
        forward_packed(model, [[1, 2], []], caches)
    with pytest.raises(ValueError, match="twice"):
        forward_packed(model, [[1], [2]], [caches[0], caches[0]])
