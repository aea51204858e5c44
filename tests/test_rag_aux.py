"""CacheClip's auxiliary selection: character-offset mapping between tokenizers, window grouping, scoring."""

import pytest
import torch
from rag_helpers import RagRunner
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvforge.reuse.rag import AuxScorer, CacheClipStrategy, ChunkReuse, make_strategy, map_scores, select_top
from kvforge.testing import tiny_model, tiny_tokenizer

DOCS = ["The cat sat on the mat, then it slept.", "Paris is the capital of France.", "The code is 7731, remember it."]
QUESTION = "What is the code?"


def word_tokenizer(texts):
    """A word-level tokenizer (words and punctuation runs) built in code from ``texts``."""
    pre = pre_tokenizers.Whitespace()
    words = sorted({w for t in texts for w, _ in pre.pre_tokenize_str(t)})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {w: i + 3 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast


def test_map_scores_word_to_char_and_back():
    text = "The code is 7731."
    char_tok, word_tok = tiny_tokenizer(), word_tokenizer([text])
    c = char_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    w = word_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert [text[a:b] for a, b in w["offset_mapping"]] == ["The", "code", "is", "7731", "."]
    word_scores = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.3])
    char_scores = map_scores(len(text), w["offset_mapping"], word_scores, c["offset_mapping"])
    expected = [0.1] * 3 + [0.0] + [0.5] * 4 + [0.0] + [0.2] * 2 + [0.0] + [0.9] * 4 + [0.3]  # spaces: no word
    torch.testing.assert_close(char_scores, torch.tensor(expected))
    # back: a word takes the max of its characters
    char_scores = torch.arange(len(text), dtype=torch.float)
    back = map_scores(len(text), c["offset_mapping"], char_scores, w["offset_mapping"])
    torch.testing.assert_close(back, torch.tensor([2.0, 7.0, 10.0, 15.0, 16.0]))


def test_map_scores_empty_span_takes_the_character_it_sits_on():
    out = map_scores(4, [(0, 2), (2, 4)], torch.tensor([1.0, 3.0]), [(0, 1), (3, 3), (1, 3)])
    torch.testing.assert_close(out, torch.tensor([1.0, 3.0, 3.0]))


def test_select_top_and_window_grouping():
    scores = torch.zeros(20)
    scores[[0, 1, 2, 3, 4, 5, 10, 17]] = torch.tensor([9.0, 8, 7, 6, 5, 4, 3, 2])
    top = select_top(scores, 0.4, window_size=1)  # 8 of 20, no grouping
    assert top.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 10, 17]
    grouped = select_top(scores, 0.4)  # window 0-7 holds 6 > 5 picked: recomputed whole
    assert grouped.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 10, 17]
    assert select_top(scores, 0.0).sum() == 0 and select_top(scores, 1.0).all()
    five = torch.zeros(8)
    five[:5] = 1.0
    assert select_top(five, 5 / 8).sum() == 5  # exactly 5 of 8 is not "more than 5"


def test_grouping_as_the_paper_states_it_recomputes_whole_windows_only():
    scores = torch.zeros(20)
    scores[[0, 1, 2, 3, 4, 5, 10, 17]] = torch.tensor([9.0, 8, 7, 6, 5, 4, 3, 2])
    windows = select_top(scores, 0.4, grouping="windows")  # window 0-7 holds 6 > 5: whole; 10 and 17 skipped
    assert windows.nonzero().flatten().tolist() == list(range(8))
    tokens = select_top(scores, 0.4, grouping="none")
    assert tokens.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 10, 17]
    with pytest.raises(ValueError, match="grouping"):
        select_top(scores, 0.4, grouping="blocks")
    with pytest.raises(ValueError, match="grouping"):
        CacheClipStrategy(grouping="blocks")


@pytest.fixture(scope="module")
def main_rag():
    return RagRunner(tiny_model("llama", num_hidden_layers=3), tiny_tokenizer())


@pytest.fixture(scope="module")
def word_aux():
    tok = word_tokenizer([*DOCS, QUESTION, "\n\n"])
    return ChunkReuse(tiny_model("qwen2", seed=3, vocab_size=len(tok)), tok)


def test_aux_scores_cover_main_tokens_through_offsets(main_rag, word_aux):
    prompt = main_rag.build_prompt(DOCS, QUESTION)
    scorer = AuxScorer(word_aux)
    scorer.warm(prompt)
    scores = scorer.score(prompt)
    assert scores.shape == (prompt.num_context_tokens,)
    assert bool((scores >= 0).all()) and float(scores.max()) > 0
    # every character of one aux word gets that word's score; spaces between words get none
    offs = prompt.chunk_offsets[2]
    part = scores[-len(prompt.chunk_ids[2]) :]
    code = DOCS[2].index("7731")
    word_span = [j for j, (a, _) in enumerate(offs) if code <= a < code + 4]
    assert len(word_span) == 4 and len({float(part[j]) for j in word_span}) == 1 and float(part[word_span[0]]) > 0
    space = [j for j, (a, _) in enumerate(offs) if DOCS[2][a] == " "]
    assert all(float(part[j]) == 0.0 for j in space)


def test_aux_with_same_tokenizer_scores_the_main_model_itself(main_rag):
    prompt = main_rag.build_prompt(DOCS, QUESTION)
    scores = AuxScorer(main_rag.reuse).score(prompt)
    assert scores.shape == (prompt.num_context_tokens,)
    # a mean of attention probabilities: the context gets at most all of the mass
    assert 0.0 < float(scores.sum()) <= 1.0 + 1e-5


def test_aux_layer_subset_scores_as_the_model_cut_to_those_layers(main_rag):
    """aux_layers=k reads layer k-1 of the model's first k layers: the same scores as a model that has only them."""
    import copy

    prompt = main_rag.build_prompt(DOCS, QUESTION)
    cut = copy.deepcopy(main_rag.model)
    cut.model.layers = cut.model.layers[:2]
    cut.config.num_hidden_layers = 2
    if getattr(cut.config, "layer_types", None):
        cut.config.layer_types = cut.config.layer_types[:2]
    expected = AuxScorer(ChunkReuse(cut, main_rag.tokenizer)).score(prompt)
    subset = AuxScorer(main_rag.reuse, num_layers=2)
    torch.testing.assert_close(subset.score(prompt), expected, atol=1e-6, rtol=0)
    assert len(main_rag.model.model.layers) == 3  # the model is given back whole
    assert not torch.allclose(AuxScorer(main_rag.reuse).score(prompt), expected)  # the last layer differs
    with pytest.raises(ValueError, match="aux_layers"):
        AuxScorer(main_rag.reuse, num_layers=4)
    # the registry's first-eight-layers variant on a 3-layer model scores with all of them
    l8 = main_rag.prefill(prompt, make_strategy("cacheclip-l8", 0.3))
    torch.testing.assert_close(l8.logits, main_rag.prefill(prompt, make_strategy("cacheclip", 0.3)).logits)


def test_cacheclip_with_a_different_tokenizer_aux(main_rag, word_aux):
    prompt = main_rag.build_prompt(DOCS, QUESTION)
    full = main_rag.prefill(prompt, make_strategy("full"))
    strategy = CacheClipStrategy(recompute_ratio=0.3, aux=word_aux)
    res = main_rag.prefill(prompt, strategy)
    assert res.num_recomputed >= round(0.3 * prompt.num_context_tokens)
    exact = CacheClipStrategy(recompute_ratio=1.0, aux=word_aux)
    torch.testing.assert_close(main_rag.prefill(prompt, exact).logits, full.logits, atol=1e-4, rtol=0)


def test_attention_capture_over_several_layers_is_the_mean_of_single_layers():
    """The capture used by CacheClip (one layer) and by the needle diagnosis (every layer) agree."""
    from kvforge.cache import KVCache
    from kvforge.prefill import forward, prefill
    from kvforge.reuse.rag.attend import AttentionCapture

    model = tiny_model("llama", num_hidden_layers=3)
    ids = torch.randint(0, 50, (1, 24))
    scores = {}
    for layers in (0, 2, [0, 2]):
        cache = KVCache.for_model(model)
        prefill(model, ids[0, :16].tolist(), cache)
        capture = AttentionCapture(cache, layers, min_query_position=16)
        cache.attention_hook = capture
        forward(model, ids[:, 16:], cache)
        scores[str(layers)] = capture.scores_by_position(24)
    for s in scores.values():  # mean attention of the 8 queries: a distribution over the 24 positions
        torch.testing.assert_close(s.sum(), torch.tensor(1.0))
    torch.testing.assert_close(scores["[0, 2]"], (scores["0"] + scores["2"]) / 2)
    assert not torch.allclose(scores["0"], scores["2"])
