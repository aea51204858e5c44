"""The CUDA path in bf16: prefill, decode, every press, store round trips and RAG on a tiny model on the GPU.

Marked ``gpu``; skipped where no CUDA device is available (``python -m pytest -m gpu`` runs only these). bf16 rounds
differently along different paths, so comparisons with a reference use bf16-sized tolerances; the exact (fp32)
equalities are the CPU tests' job. What these tests catch is a CPU-only assumption: a tensor created without
``device=``, a ``.numpy()`` on a CUDA tensor, a CPU index into CUDA data, a kernel path that only exists on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvforge.attention import attend, attention_scores, sdpa
from kvforge.cache import KVCache
from kvforge.decode import decode
from kvforge.kvzap_train import ensure_trained
from kvforge.prefill import forward, prefill
from kvforge.presses import PRESSES, build_press, compress_prefill
from kvforge.store import DiskStore, MemoryStore
from kvforge.store.codec import quant_roundtrip, segments_equal
from kvforge.testing import split_words, tiny_model, tiny_tokenizer

# KVFORGE_TEST_DEVICE=cpu runs these tests' logic on CPU (a check of the tests themselves, not of the GPU path)
CUDA = os.environ.get("KVFORGE_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(CUDA == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16 = dict(atol=3e-2, rtol=3e-2)


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "kvforge-cache"))


def _model(arch: str = "llama", dtype: torch.dtype = torch.bfloat16):
    return tiny_model(arch).to(CUDA, dtype)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 99, (1, n), generator=torch.Generator().manual_seed(seed)).to(CUDA)


def _on_cuda(cache: KVCache) -> bool:
    want = torch.device(CUDA).type
    held = [(layer.keys.device.type, layer.positions.device.type) for layer in cache.layers if layer.keys is not None]
    return all(k == p == want for k, p in held)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("q_len", "k_len", "kv_heads"), [(8, 40, 2), (8, 40, 4), (1, 33, 2), (16, 16, 2)])
def test_lower_right_causal_kernels_equal_the_masked_reference(dtype, q_len, k_len, kv_heads):
    g = torch.Generator(device=CUDA).manual_seed(0)
    q = torch.randn(1, 4, q_len, 64, device=CUDA, dtype=dtype, generator=g)
    k, v = (torch.randn(1, kv_heads, k_len, 64, device=CUDA, dtype=dtype, generator=g) for _ in range(2))
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=CUDA).tril(k_len - q_len)[None, None]
    ref = attend(torch.softmax(attention_scores(q, k, mask, False, None, None), -1), v)
    torch.testing.assert_close(sdpa(q, k, v, None, q_len > 1, None).float(), ref.float(), **BF16)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@torch.no_grad()
def test_chunked_prefill_on_cuda_matches_one_shot_and_transformers(arch):
    model = _model(arch)
    ids = _ids(96)
    one = prefill(model, ids, c1 := KVCache.for_model(model), chunk_size=None)
    chunked = prefill(model, ids, c2 := KVCache.for_model(model), chunk_size=32)
    assert _on_cuda(c1) and _on_cuda(c2) and one.device.type == torch.device(CUDA).type and one.dtype == torch.bfloat16
    torch.testing.assert_close(chunked.float(), one.float(), **BF16)
    torch.testing.assert_close(one.float(), model(ids).logits[:, -1].float(), **BF16)


@torch.no_grad()
def test_decode_on_cuda_follows_the_uncached_model():
    model = _model()
    ids = _ids(40, seed=1)
    cache = KVCache.for_model(model)
    logits = prefill(model, ids, cache, chunk_size=16)
    out = decode(model, cache, logits, 8)
    assert len(out.token_ids) == 8 and cache.next_position == 47
    # teacher-forced: each cached step's logits match transformers' uncached forward of the same tokens
    seq = torch.cat([ids, torch.tensor([out.token_ids[:-1]], device=CUDA)], dim=1)
    full = model(seq).logits[0, ids.shape[1] - 1 :].float()
    replay = KVCache.for_model(model)
    steps = [prefill(model, ids, replay, chunk_size=16)[0]]
    for t in out.token_ids[:-1]:
        steps.append(forward(model, [t], replay)[0, -1])
    torch.testing.assert_close(torch.stack(steps).float(), full, **BF16)


@pytest.mark.parametrize("name", sorted(PRESSES))
@torch.no_grad()
def test_every_press_compresses_and_decodes_on_cuda(name):
    model = _model()
    try:
        press = build_press(name, 0.5, window_size=16)
    except Exception:
        press = build_press(name, 0.5)
    ensure_trained(press, model, tiny_tokenizer())  # a learned scorer (KVzap): trained once per model, on CUDA
    cache = KVCache.for_model(model)
    logits = compress_prefill(model, _ids(120, seed=2), cache, press, chunk_size=48, tokenizer=tiny_tokenizer())
    assert _on_cuda(cache) and cache.next_position == 120
    for _ in range(3):
        logits = forward(model, logits.argmax(-1, keepdim=True), cache)[:, -1]
        assert torch.isfinite(logits).all()
    if name != "full":
        assert cache.num_entries() < KVCache.for_model(model).num_layers * 2 * 120


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_store_round_trips_of_a_cuda_cache(tmp_path, quant):
    model = _model()
    cache = KVCache.for_model(model)
    prefill(model, _ids(50, seed=3), cache)
    segment = cache.to_segment("tiny")
    assert segment.keys[0].device.type == torch.device(CUDA).type
    for store in (MemoryStore(), DiskStore(tmp_path / "kv")):
        store.put("k1", segment if quant is None else quant_roundtrip(segment, quant))
        back = store.get("k1")
        assert back is not None
        if quant is None:
            cpu = quant_roundtrip(segment, None)  # the bit-exact copy a store hands back (on CPU)
            assert segments_equal(back, cpu)
        loaded = KVCache.from_segment(back.to(CUDA), model)
        logits = forward(model, [5], loaded)
        assert torch.isfinite(logits).all()


@pytest.mark.parametrize("strategy", ["naive", "cacheblend", "ape"])
@torch.no_grad()
def test_rag_chunk_reuse_on_cuda(strategy):
    from rag_helpers import RagRunner  # the path every caller takes: ChunkReuse.plan -> Engine.prefill_plan

    from kvforge.reuse.rag import make_strategy

    rag = RagRunner(_model(), tiny_tokenizer())
    prompt = rag.build_prompt(["The cat sat on the mat.", "The code is 7731, remember it."], "What is the code?")
    full = rag.prefill(prompt, make_strategy("full"))
    res = rag.prefill(prompt, make_strategy(strategy, **({"recompute_ratio": 1.0} if strategy == "cacheblend" else {})))
    assert res.num_reused > 0 or strategy == "cacheblend"  # chunk KV really reused (cacheblend at 1.0 recomputes all)
    assert torch.isfinite(res.logits).all() and _on_cuda(res.cache)
    if strategy == "cacheblend":  # everything recomputed: the full prefill again
        torch.testing.assert_close(res.logits.float(), full.logits.float(), **BF16)


@pytest.mark.parametrize("name", ["kvzip-plus:budget=head:whole_words=true", "kvzip:whole_words=true"])
@torch.no_grad()
def test_whole_words_on_cuda_keep_words_whole_with_the_cpu_budget(name):
    """Words (read on CPU from the tokenizer) meet scores on the GPU: each layer keeps the entries a float32 CPU run
    keeps in number, and in every KV head a word of the body is kept whole or dropped, but for the one the budget cuts
    and the one the header's end falls in. (Which entries tie-break the cut may differ between the devices.)"""
    from kvforge.presses.layer import word_ids
    from kvforge.presses.replay import header_length

    tok = tiny_tokenizer()
    text = "The code of the gate is 4711-0815; remember 99 red balloons and 1234567. " * 2
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    words, header = word_ids(tok, ids[0].tolist()), header_length(tok, ids[0].tolist()) + 4
    counts = {}
    for device in (CUDA, "cpu"):
        model = tiny_model("llama").to(device, torch.float32)
        cache = KVCache.for_model(model)
        compress_prefill(model, ids.to(device), cache, build_press(name, 0.6), chunk_size=48, tokenizer=tok)
        counts[device] = cache.num_entries()
        if device == CUDA:
            for split in split_words(cache, words, header):
                assert len(split) <= 2, split
    assert counts[CUDA] == counts["cpu"]
