"""Compressed documents as vLLM holds them, without vLLM: the kept entries in slots ``0..k-1`` with keys rotated by
``k - n``, and the question at positions ``k, k+1, ...``, give a plain transformers forward exactly the logits kvforge's
engine gives the question at ``n, n+1, ...`` on the same compressed cache; the descriptions, placeholders and request
parameters that name a stored document."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvforge.cache import KVCache
from kvforge.compat import cache_arg, dynamic_cache
from kvforge.engine import Engine
from kvforge.errors import UserError
from kvforge.rope import rope_spec, rope_spec_from_config
from kvforge.store import open_store
from kvforge.testing import tiny_model, tiny_tokenizer
from kvforge.vllm import documents as docs
from kvforge.vllm.client import VllmDocuments, uniform_press

DOC = "The keeper of the lighthouse wrote the code 4817 on the wall. " * 6 + "Gulls circled the rocks all day."
QUESTION = "What code did the keeper write?"


@pytest.fixture(scope="module")
def setup():
    model, tokenizer = tiny_model("llama", num_hidden_layers=3), tiny_tokenizer()
    engine = Engine(model, tokenizer)
    client = VllmDocuments(open_store("memory://"), tokenizer, engine.model_id, uniform_press("kvzip", 0.75),
                           engine=engine, slot_multiple=16)  # fmt: skip
    (doc,) = client.add([DOC])
    return engine, client, doc


def _kvforge_logits(engine, client):
    key, q_ids = client.key(DOC, QUESTION)
    segment = client.store.get(key)
    cache = KVCache.from_segment(segment)
    _, logits = engine.prefill(q_ids, cache=cache)
    return logits.reshape(-1), q_ids, segment


def _slot_logits(model, segment, doc, q_ids):
    """A plain transformers forward over the slots as vLLM holds them, the question at positions k, k+1, ..."""
    keys, values = docs.slot_kv(segment, doc, rope_spec(model), torch.float32)
    cache = dynamic_cache([(k[None], v[None]) for k, v in zip(keys, values, strict=True)])
    positions = torch.arange(doc.num_slots, doc.num_slots + len(q_ids))[None]
    with torch.no_grad():
        out = model(torch.tensor([q_ids]), position_ids=positions, use_cache=True, **cache_arg(model, cache))
    return out.logits[0, -1]


def test_slots_rotated_by_k_minus_n_give_kvforges_logits(setup):
    engine, client, doc = setup
    expected, q_ids, segment = _kvforge_logits(engine, client)
    assert doc.num_slots == docs.uniform_slots(segment) == 96  # 102 of 409 kept, rounded down to whole blocks of 16
    got = _slot_logits(engine.model, segment, doc, q_ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    unrotated = dataclasses.replace(doc, num_tokens=doc.num_slots)  # the slots' keys left where they were
    assert (_slot_logits(engine.model, segment, unrotated, q_ids) - expected).abs().max() > 1e-3


def test_rope_from_the_config_alone_is_the_models():
    model = tiny_model("llama")
    a, b = rope_spec(model), rope_spec_from_config(model.config)
    assert all(torch.equal(x, y) for x, y in zip(a.inv_freq, b.inv_freq, strict=True))


def test_a_match_is_the_placeholder_then_the_question_and_params_round_trip(setup):
    _, client, doc = setup
    match = client.match(DOC, QUESTION)
    assert match is not None and match.doc == doc
    _, q_ids = client.key(DOC, QUESTION)
    assert match.prompt_ids == doc.placeholder_ids() + q_ids
    assert len(set(match.prompt_ids[: doc.num_slots])) > 1 and max(match.prompt_ids) < len(client.tokenizer)
    body = match.completion()
    assert docs.ServedDocument.from_params(json.loads(json.dumps(body["kv_transfer_params"]))) == doc
    assert client.match(DOC + " One more sentence.", QUESTION) is None  # another document: not stored
    assert docs.ServedDocument.from_params({"other": 1}) is None


def test_placeholders_differ_per_document_and_per_write(setup):
    _, client, doc = setup
    again = docs.describe(client.store.get(doc.key), doc.key, doc.vocab_size)
    assert again.nonce != doc.nonce and again.placeholder_ids() != doc.placeholder_ids()
    assert doc.placeholder_ids() == doc.placeholder_ids()  # deterministic
    other = dataclasses.replace(doc, key="doc-v1-" + "0" * 40)
    assert other.placeholder_ids() != doc.placeholder_ids()


def test_a_withdrawn_description_is_a_miss_and_is_made_anew(setup):
    _, client, doc = setup
    docs.withdraw(client.store, doc.key)
    assert docs.find(client.store, doc.key) is None
    match = client.match(DOC, QUESTION)  # the document is still stored: described again, with a new nonce
    assert match is not None and match.doc.nonce != doc.nonce and match.doc.num_slots == doc.num_slots


def _params(**fields):
    good = {"key": "doc-v1-ab", "num_tokens": 4, "num_slots": 1, "nonce": "a" * 16, "vocab_size": 9}
    return {"kvforge_document": good | fields}


@pytest.mark.parametrize(
    "params, message",
    [
        ({"kvforge_document": "x"}, "must be an object"),
        (_params(key="../etc"), "kvforge document key"),
        (_params(num_slots=5), "5 slots for a document of 4"),
        (_params(num_tokens=True), "positive integer"),
        (_params(nonce="x"), "nonce"),
    ],
)
def test_malformed_parameters_are_refused(params, message):
    with pytest.raises(docs.DocumentError, match=message):
        docs.ServedDocument.from_params(params)


def test_ragged_documents_and_presses_are_refused():
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    engine = Engine(model, tokenizer)
    with pytest.raises(UserError, match="budget=head"):
        uniform_press("kvzip:budget=layer", 0.5)
    with pytest.raises(UserError, match="different number of entries"):
        uniform_press("adakv", 0.5)
    assert uniform_press("kvzip", 0.5).budget == "token" and uniform_press("kvzap", 0.5).budget == "token"
    assert uniform_press("kvzip:budget=head", 0.5).budget == "head"
    # words kept whole by default under one count per head, unless the name says otherwise
    assert uniform_press("kvzip-plus", 0.5).whole_words and uniform_press("kvzip:budget=token", 0.5).whole_words
    assert not uniform_press("kvzip:whole_words=false", 0.5).whole_words
    from kvforge.presses import build_press

    ragged = VllmDocuments(open_store("memory://"), tokenizer, engine.model_id, build_press("kvzip", 0.75),
                           engine=engine)  # fmt: skip
    with pytest.raises(docs.DocumentError, match="one count for every layer and head"):
        ragged.add([DOC])


@pytest.mark.parametrize("multiple", [None, 16, 32, 128])
def test_documents_keep_whole_blocks_of_slots_and_are_matched(setup, multiple):
    """The kept count is the press's own rounded down to a multiple of ``slot_multiple`` (vLLM caches whole blocks
    only; a count under one block stays as it is), the same press at another ratio, and the key a question computes
    finds it."""
    from kvforge.presses.base import num_kept

    _, client, _ = setup
    blocks = dataclasses.replace(client, store=open_store("memory://"), slot_multiple=multiple, _reuse=None)
    (doc,) = blocks.add([DOC])
    own = num_kept(doc.num_tokens, 0.75)
    assert own == 102 and doc.num_slots == {None: 102, 16: 96, 32: 96, 128: 102}[multiple]
    assert blocks.match(DOC, QUESTION).doc == doc
    assert blocks.match(DOC, QUESTION).prompt_ids[: doc.num_slots] == doc.placeholder_ids()


def test_the_announcement_carries_vllms_block_size_and_older_ones_still_read():
    from kvforge.vllm.identity import ServedModel, announce, blob_key, find_served

    store = open_store("memory://")
    announce(store, ServedModel("/models/a", "id-a", 256, 128))
    assert find_served(store, "/models/a") == ServedModel("/models/a", "id-a", 256, 128)
    older = {"model": "/models/b", "model_id": "id-b", "block_size": 256}
    store.put_blob(blob_key("/models/b"), json.dumps(older).encode())
    assert find_served(store, "/models/b").kv_block_size is None  # written by an older connector
