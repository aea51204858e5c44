"""Compressed documents served by a real vLLM engine (CPU build, in-process, tiny random Llama): a document compressed
once by kvforge and stored is loaded by the connector into a quarter of the request's slots, and vLLM's greedy
tokens and log-probabilities for a question on it equal kvforge's engine's on the same compressed cache.

Needs vLLM: run by ``scripts/ci_vllm.sh`` (every supported vLLM release); skipped (one line) where vLLM is not
importable.
"""

from __future__ import annotations

import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as e:  # not installed, or installed with broken vision/audio wheels
    pytest.skip(f"vLLM is not importable here ({type(e).__name__}: {str(e)[:80]})", allow_module_level=True)

from vllm_engine import TEXT, run

from kvforge.engine import Engine
from kvforge.model import load_model
from kvforge.request import Document, Request
from kvforge.store import open_store
from kvforge.vllm import documents as docs
from kvforge.vllm.client import VllmDocuments, uniform_press

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_in_process")]

DOC = TEXT[:900]
QUESTIONS = ["What did the narrator do?", "Where does the story happen?"]


def _client(model_dir, url: str, press: str = "kvzip", quant: str | None = None) -> VllmDocuments:
    model, tokenizer = load_model(str(model_dir), device="cpu")
    engine = Engine(model, tokenizer)
    return VllmDocuments(open_store(url), tokenizer, engine.model_id, uniform_press(press, 0.75), quant, engine)


def _kvforge_answer(client: VllmDocuments, question: str, num_tokens: int) -> dict:
    press = client.press_for(num_tokens)  # the press the document was stored with (whole blocks of slots)
    gen = client.engine.run(Request(Document(DOC, question), max_new_tokens=8, press=press, query_aware=False,
                                    reuse=client.reuse, quant=client.quant, logprobs=5))  # fmt: skip
    assert gen.reused_tokens > 0  # answered from the stored compressed document
    return {"tokens": gen.token_ids, "top": [dict(alts) for _, _, alts in gen.info["logprobs"]]}


def _assert_same(vllm_answer: dict, kvforge_answer: dict, tol: float = 1e-4) -> None:
    assert vllm_answer["tokens"] == kvforge_answer["tokens"]
    for theirs, ours in zip(vllm_answer["top"], kvforge_answer["top"], strict=True):
        common = sorted(set(theirs) & set(ours))
        assert len(common) >= 4  # the same top alternatives (a tie may swap the last)
        torch.testing.assert_close(torch.tensor([theirs[t] for t in common]), torch.tensor([ours[t] for t in common]),
                                   rtol=0, atol=tol)  # fmt: skip


@pytest.mark.parametrize("press", ["kvzip", "knorm"])
def test_vllm_answers_from_a_quarter_of_the_slots_with_kvforges_logits(vllm_model_dir, tmp_path, press):
    url = f"file://{tmp_path}/kv"
    client = _client(vllm_model_dir, url, press)
    (doc,) = client.add([DOC])
    assert doc.num_slots == int(doc.num_tokens * 0.25) // 128 * 128  # whole blocks of vLLM's (CPU) cache
    matches = [client.match(DOC, q) for q in QUESTIONS]
    expected = [_kvforge_answer(client, q, doc.num_tokens) for q in QUESTIONS]
    client.store.close()
    answers = run(vllm_model_dir, [m.prompt_ids for m in matches], url, params=[m.doc.params() for m in matches],
                  logprobs=5)  # fmt: skip
    from kvforge.vllm.identity import find_served

    assert find_served(open_store(url), str(vllm_model_dir)).kv_block_size == 128  # vLLM's CPU block size, announced
    for answer, want, match in zip(answers, expected, matches, strict=True):
        assert answer["cached"] == doc.num_slots  # the document's slots came from the store, nothing recomputed
        assert len(answer["prompt_ids"]) == doc.num_slots + len(match.prompt_ids) - doc.num_slots
        assert answer["kv_transfer_params"][docs.PARAM] == {"key": doc.key, "loaded": True, "slots": doc.num_slots}
        _assert_same(answer, want)


def test_transform_coded_documents_load_too(vllm_model_dir, tmp_path):
    url = f"file://{tmp_path}/kv"
    client = _client(vllm_model_dir, url, quant="kvtc-b4")
    (doc,) = client.add([DOC])
    match = client.match(DOC, QUESTIONS[0])
    want = _kvforge_answer(client, QUESTIONS[0], doc.num_tokens)
    client.store.close()
    (answer,) = run(vllm_model_dir, [match.prompt_ids], url, params=[match.doc.params()], logprobs=5)
    assert answer["cached"] == doc.num_slots
    _assert_same(answer, want, tol=1e-3)  # both decode the same stored bytes


def test_a_document_no_longer_described_is_reported_not_loaded_and_never_reused(vllm_model_dir, tmp_path):
    url = f"file://{tmp_path}/kv"
    client = _client(vllm_model_dir, url)
    (doc,) = client.add([DOC])
    match = client.match(DOC, QUESTIONS[0])
    docs.withdraw(client.store, doc.key)  # as if stored again (a new nonce) or evicted since the match
    client.store.close()
    (answer,) = run(vllm_model_dir, [match.prompt_ids], url, params=[match.doc.params()])
    assert answer["cached"] == 0
    assert answer["kv_transfer_params"][docs.PARAM]["loaded"] is False
    again = client.match(DOC, QUESTIONS[0])
    assert again is not None and again.doc.nonce != doc.nonce  # a new placeholder: the old one is never sent again
