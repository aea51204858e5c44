"""Chunk precompute and storage: keys, stored ids checked on a hit, only the chunk's KV kept."""

import torch

from kvforge.cache import KVCache
from kvforge.prefill import prefill
from kvforge.reuse.rag import ChunkCache, ChunkReuse, build_prompt, chunk_key
from kvforge.store.memory import MemoryStore
from kvforge.testing import tiny_model, tiny_tokenizer

DOCS = ["The cat sat on the mat.", "Paris is the capital of France.", "Numbers: 1234 5678."]


def test_prompt_pieces_concatenate_to_the_prompt():
    tok = tiny_tokenizer()
    p = build_prompt(tok, DOCS, "Where?", system="Be brief.")
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "\n\n".join(DOCS) + "\n\nWhere?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert p.ids() == tok(text, add_special_tokens=False)["input_ids"]  # char tokenizer: pieces == joined text
    assert p.prefix_ids == tok("<s>Be brief.\n<u>", add_special_tokens=False)["input_ids"]
    assert [len(o) for o in p.chunk_offsets] == [len(c) for c in p.chunk_ids]
    assert p.num_context_tokens == sum(len(d) for d in DOCS)


def test_chunk_key_depends_on_model_prefix_and_chunk():
    base = chunk_key("m", [1, 2], [5, 6])
    assert base == chunk_key("m", [1, 2], [5, 6])  # deterministic (no Python hash)
    assert base.startswith("rag-v2-") and len(base) == 7 + 64 and int(base[7:], 16) >= 0
    others = {
        chunk_key("n", [1, 2], [5, 6]),
        chunk_key("m", [1], [2, 5, 6]),
        chunk_key("m", [1, 2], [5, 7]),
        chunk_key("m", [1, 2], None),
        chunk_key("m", [1, 2], []),
    }
    assert base not in others and len(others) == 5


def test_chunk_segment_is_the_chunk_part_of_prefix_plus_chunk():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    rag = ChunkReuse(model, tok)
    p = rag.build_prompt(DOCS, "Where?")
    seg = rag.chunks.chunk(p.prefix_ids, p.chunk_ids[1])
    plen, n = len(p.prefix_ids), len(p.chunk_ids[1])
    assert seg.token_ids == p.chunk_ids[1] and seg.model_id == rag.model_id
    cache = KVCache.for_model(model)
    prefill(model, p.prefix_ids + p.chunk_ids[1], cache)
    for layer, k, v, pos in zip(cache.layers, seg.keys, seg.values, seg.positions, strict=True):
        k_ref, v_ref, _, _ = layer.view()
        assert k.shape[1] == n
        assert torch.equal(pos[0], torch.arange(plen, plen + n))
        torch.testing.assert_close(k, k_ref[0, :, plen:])
        torch.testing.assert_close(v, v_ref[0, :, plen:])


def test_store_hit_reuses_and_checks_ids():
    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    store = MemoryStore()
    chunks = ChunkCache(model, "model-a", store)
    p = build_prompt(tok, DOCS, "Where?")
    chunks.warm(p)
    assert (chunks.num_misses, chunks.num_hits) == (3, 0)
    assert len(store.keys()) == 4  # prefix + 3 chunks
    first = chunks.chunk(p.prefix_ids, p.chunk_ids[0])
    assert chunks.num_hits == 1
    # a segment holding other tokens under the key is not trusted: recomputed and overwritten
    key = chunk_key("model-a", p.prefix_ids, p.chunk_ids[0])
    bad = store.get(key)
    bad.token_ids = list(reversed(bad.token_ids))
    store.put(key, bad)
    again = chunks.chunk(p.prefix_ids, p.chunk_ids[0])
    assert chunks.num_misses == 4 and again.token_ids == p.chunk_ids[0]
    torch.testing.assert_close(again.keys[1], first.keys[1])
    # another model's fingerprint never shares entries
    other = ChunkCache(model, "model-b", store)
    other.chunk(p.prefix_ids, p.chunk_ids[0])
    assert other.num_misses == 1


def test_loading_chunks_reports_progress_over_their_tokens():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    rag = ChunkReuse(model, tok)
    calls: list[tuple[int, int]] = []
    rag.on_chunk_loaded = lambda done, total: calls.append((done, total))
    p = rag.build_prompt(DOCS, "Where?")
    rag.load(p)
    sizes = [len(c) for c in p.chunk_ids]
    total = sum(sizes)
    assert calls == [(sum(sizes[: i + 1]), total) for i in range(len(sizes))]  # one call per chunk, ending at total
