"""KVzip as its paper does it, Knorm and Expected Attention: budgets, protected header, replay turn, calibration."""

from __future__ import annotations

import functools

import pytest
import torch

import kvforge.presses.apply as apply_mod
import kvforge.presses.replay as replay_mod
from kvforge.cache import KVCache
from kvforge.errors import UserError
from kvforge.presses import KVzipPress, LayerContext, build_press, compress_prefill, compressible_layers, num_kept
from kvforge.presses.expected_attention import ExpectedAttentionPress, averaged_rope, rotate
from kvforge.presses.kvzip_heads import calibration_path, load_head_scores, save_head_scores
from kvforge.presses.replay import REPEAT_PART_PROMPT, REPEAT_PROMPT, header_length, replay_prefix
from kvforge.testing import split_words, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "The quick brown fox jumps over the lazy dog; the secret code is 4711. " * 3


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "kvforge-cache"))


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def chat_ids(tok, text: str = TEXT) -> torch.Tensor:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
    return torch.tensor([tok.encode(rendered, add_special_tokens=False)])


def ctx(s: int, seed: int, header: int = 0, layer: int = 0) -> LayerContext:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(1, 4, s, generator=g) * (1 + 9 * layer)  # later layers: larger scores
    scores[..., :10] = 0.0  # the first entries look useless: they must still be kept when protected
    return LayerContext(
        keys=torch.randn(1, 2, s, 8, generator=g),
        values=torch.randn(1, 2, s, 8, generator=g),
        positions=torch.arange(s)[None],
        num_heads=4,
        reconstruction_scores=scores,
        output_weight=torch.randn(16, 32, generator=g),
        header_length=header,
    )


@pytest.mark.parametrize("ratio", [0.3, 0.75, 0.9])
def test_global_budget_sum_over_layers_is_exact_and_lengths_differ(ratio):
    s = 120
    contexts = [ctx(s, seed=i, layer=i) for i in range(3)]
    sels = KVzipPress(compression_ratio=ratio, budget="global").compress_all(contexts)
    kept = [int(sel.keep.sum()) for sel in sels]
    assert sum(kept) == 3 * 2 * num_kept(s, ratio)
    assert len(set(kept)) > 1  # one top-k over the model: layers keep different amounts
    assert all(int(c) >= 1 for sel in sels for c in sel.keep.sum(-1).flatten())  # no head left empty


@pytest.mark.parametrize("name", ["kvzip", "kvzip-plus"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_global_budget_exact_per_model(tok, name, arch, ratio):
    """Through compress_prefill on a whole model: the kept entries summed over the compressed layers are exactly the
    model budget (one top-k over every layer, head and token)."""
    model = tiny_model(arch)
    ids = chat_ids(tok)
    cache = KVCache.for_model(model)
    compress_prefill(model, ids, cache, build_press(name, ratio), chunk_size=64, tokenizer=tok)
    layers = compressible_layers(cache)
    n, h_kv = ids.shape[1], model.config.num_key_value_heads
    assert sum(cache.layers[i].num_entries() for i in layers) == len(layers) * h_kv * num_kept(n, ratio)
    assert sum(cache.info["press"]["kept_entries_per_layer"][i] for i in layers) == len(layers) * h_kv * num_kept(
        n, ratio
    )
    full = KVCache.for_model(model)
    apply_mod.prefill(model, ids, full, chunk_size=64)
    assert cache.nbytes() < full.nbytes()  # memory really freed (head-wise layout)


@pytest.mark.parametrize("budget", ["head", "layer", "global"])
def test_header_and_first_tokens_always_kept(budget):
    press = KVzipPress(compression_ratio=0.9, budget=budget, keep_first=2)
    for sel in press.compress_all([ctx(100, seed=1, header=5), ctx(100, seed=2, header=5)]):
        assert bool(sel.keep[..., :7].all())
    off = KVzipPress(compression_ratio=0.9, budget=budget, keep_first=0, keep_header=False)
    assert not bool(off.compress_all([ctx(100, seed=1, header=5)])[0].keep[..., :7].all())


@pytest.mark.parametrize("name", ["kvzip", "kvzip-layer", "kvzip-plus", "kvzip-ada", "kvzip-global"])
def test_header_kept_through_compress_prefill(tok, name):
    """The template header (3 tokens here) and the first entry survive in every head of every layer at 90% removed,
    whatever their replay scores (the header is never repeated, so without protection it would score ~0)."""
    model = tiny_model("llama")
    ids = chat_ids(tok)
    assert header_length(tok, ids[0].tolist()) == 3  # "<u>"
    cache = KVCache.for_model(model)
    compress_prefill(model, ids, cache, build_press(name, 0.9, keep_first=1), chunk_size=64, tokenizer=tok)
    for layer in cache.layers:
        _, _, positions, valid = layer.view()
        for head in range(positions.shape[1]):
            pos = positions[0, head] if valid is None else positions[0, head][valid[0, head]]
            assert {0, 1, 2, 3} <= set(pos.tolist())


def test_replay_is_a_chunked_chat_turn(tok, monkeypatch):
    calls: list[list[int]] = []
    real = apply_mod.prefill

    def spy(model, ids, cache, **kw):
        calls.append(torch.as_tensor(ids)[0].tolist())
        return real(model, ids, cache, **kw)

    monkeypatch.setattr(apply_mod, "prefill", spy)  # the prompt's prefill
    monkeypatch.setattr(replay_mod, "prefill", spy)  # the replay's
    model, ids = tiny_model("llama"), chat_ids(tok)
    press = build_press("kvzip", 0.5, replay_chunk=50, replay_turn="new")
    compress_prefill(model, ids, KVCache.for_model(model), press, tokenizer=tok)
    prefix = replay_prefix(tok, REPEAT_PROMPT, True)
    assert tok.decode(prefix) == "<u>" + REPEAT_PROMPT + "\n<a>"  # a user turn, then the assistant's answer
    context = ids[0].tolist()[3:]  # the header is kept, not repeated
    replays = calls[1:]
    assert replays == [prefix + context[a : a + 50] for a in range(0, len(context), 50)]
    assert len(replays) > 1  # chunked
    bare = replay_prefix(tok, REPEAT_PROMPT, False)
    assert tok.decode(bare) == "\n\n" + REPEAT_PROMPT + "\n"


def test_replay_continues_the_user_turn_as_kvzip_does(tok, monkeypatch):
    """Default layout (KVzip / kvpress): the request continues the user turn holding the context, the turn is closed,
    the assistant repeats; later chunks quote the previous chunk's last 8 tokens."""
    calls: list[list[int]] = []
    real = apply_mod.prefill
    def spy(model, ids, cache, **kw):
        calls.append(torch.as_tensor(ids)[0].tolist())
        return real(model, ids, cache, **kw)

    monkeypatch.setattr(apply_mod, "prefill", spy)  # the prompt's prefill
    monkeypatch.setattr(replay_mod, "prefill", spy)  # the replay's
    model = tiny_model("llama")
    rendered = tok.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(rendered[: rendered.index(TEXT) + len(TEXT)], add_special_tokens=False)])
    compress_prefill(model, ids, KVCache.for_model(model), build_press("kvzip", 0.5, replay_chunk=50), tokenizer=tok)
    context = ids[0].tolist()[3:]
    suffix = rendered[rendered.index(TEXT) + len(TEXT) :]  # end of the user turn + the assistant's header
    first = tok.encode("\n\n" + REPEAT_PROMPT, add_special_tokens=False) + tok.encode(suffix, add_special_tokens=False)
    assert calls[1] == first + context[:50]
    later = tok.encode("\n\n" + REPEAT_PART_PROMPT, add_special_tokens=False)
    assert calls[2] == later + context[42:50] + tok.encode(suffix, add_special_tokens=False) + context[50:100]


def test_calibration_refused_for_another_model(tok, tmp_path):
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids = chat_ids(tok)
    compress_prefill(a, ids, KVCache.for_model(a), build_press("kvzip-head", 0.5), tokenizer=tok)
    files = list((tmp_path / "kvforge-cache" / "kvzip-heads").glob("*.json"))
    assert len(files) == 1
    with pytest.raises(UserError, match="was made for model"):
        press = build_press("kvzip-head", 0.5, calibration=str(files[0]))
        compress_prefill(b, ids, KVCache.for_model(b), press, tokenizer=tok)
    path = tmp_path / "x.json"
    save_head_scores(path, "model-A", [[1.0, 2.0]])
    assert load_head_scores(path, "model-A") == [[1.0, 2.0]]
    with pytest.raises(UserError, match="model-A"):
        load_head_scores(path, "model-B")
    path.write_text("{not json")
    with pytest.raises(UserError, match="cannot read"):
        load_head_scores(path, "model-A")
    assert calibration_path("A:b/c").name == "A_b_c.json"


def test_head_level_reuses_calibration_without_replay(tok, monkeypatch):
    model, ids = tiny_model("llama"), chat_ids(tok)
    compress_prefill(model, ids, KVCache.for_model(model), build_press("kvzip-head", 0.5), tokenizer=tok)

    def no_replay(*args, **kwargs):
        raise AssertionError("head-level mode replayed the context after calibration")

    monkeypatch.setattr(apply_mod, "replay_scores", no_replay)
    cache = KVCache.for_model(model)
    compress_prefill(model, chat_ids(tok, TEXT[::-1]), cache, build_press("kvzip-head", 0.75), tokenizer=tok)
    n = chat_ids(tok, TEXT[::-1]).shape[1]
    assert all(layer.num_entries() == 2 * num_kept(n, 0.75) for layer in cache.layers)


def test_knorm_keeps_lowest_key_norms():
    c = ctx(50, seed=3)
    keep = build_press("knorm", 0.8).compress(c).keep
    norms = c.keys.norm(dim=-1)
    for h in range(2):
        assert norms[0, h][keep[0, h]].max() <= norms[0, h][~keep[0, h]].min()


def test_averaged_rope_is_the_mean_rotation():
    angles = 10000.0 ** (-torch.arange(4) * 2.0 / 8)
    x = torch.randn(3, 8)
    cos, sin = averaged_rope(angles, 10, 7)
    want = torch.stack([rotate(x, (p * angles).cos(), (p * angles).sin()) for p in range(11, 18)]).mean(0)
    torch.testing.assert_close(rotate(x, cos, sin), want, rtol=1e-5, atol=1e-5)


def test_expected_attention_matches_the_gaussian_formula():
    c = ctx(40, seed=4)
    g = torch.Generator().manual_seed(5)
    c.query_mean = torch.randn(1, 4, 8, generator=g)
    a = torch.randn(1, 4, 8, 8, generator=g)
    c.query_cov = a @ a.transpose(-1, -2) / 8
    scores = ExpectedAttentionPress(compression_ratio=0.5, n_sink=0).score(c)
    d = 8**-0.5
    for h in range(4):
        k = c.keys[0, h // 2]
        logits = k @ c.query_mean[0, h] * d + ((k @ c.query_cov[0, h]) * k).sum(-1) * d * d / 2
        if h % 2 == 0:
            group = logits.softmax(-1) / 2
        else:
            torch.testing.assert_close(
                scores[0, h // 2], (group + logits.softmax(-1) / 2) * c.values[0, h // 2].norm(dim=-1)
            )


class TextbookReplay:
    """Reference for the replay's scoring: softmax(q k^T * scale) in float64 with keys repeated per group, over every
    key (``normalise="all"``) or over the sinks, the repeated chunk and the replay's keys (``"chunk"``, KVzip's)."""

    def __init__(self, bounds, normalise="all", sinks=0):
        self.bounds, self.normalise, self.sinks, self.chunk, self.scores = bounds, normalise, sinks, None, {}

    def __call__(self, module, query, key, value, mask, is_causal, scaling, softcap):
        if is_causal:  # a plain cache continued: the queries are the last rows (lower-right causal, no mask built)
            assert mask is None
            mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool).tril(key.shape[2] - query.shape[2])
        g = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
        logits = (query.double() @ k.double().transpose(-1, -2)) * scaling
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits if mask is None else logits.masked_fill(~mask, float("-inf"))
        probs = logits.softmax(-1)
        span = self.bounds.get(module.layer_idx)
        if span is not None:
            best = self.scores.get(module.layer_idx)
            if best is None:
                best = torch.zeros(query.shape[0], query.shape[1], span[1] - span[0])
            lo, hi = span[0] + self.chunk[0], span[0] + self.chunk[1]
            if self.normalise == "chunk":
                keep = torch.zeros(key.shape[2], dtype=torch.bool)
                keep[: min(self.sinks, lo)] = keep[lo:hi] = keep[span[1] :] = True
                got = logits.masked_fill(~keep, float("-inf")).softmax(-1)[..., lo:hi].amax(dim=2).float()
                best[..., lo - span[0] : hi - span[0]] = torch.maximum(best[..., lo - span[0] : hi - span[0]], got)
            else:
                best = torch.maximum(best, probs[..., span[0] : span[1]].amax(dim=2).float())
            self.scores[module.layer_idx] = best
        return (probs.to(v.dtype) @ v).transpose(1, 2).contiguous()


def replay_scores_and_kept(model, tok, ids, replay_chunk=40, **options):
    source = apply_mod.CompressionSource(
        model, ids, KVCache.for_model(model), apply_mod.Needs(reconstruction=True), chunk_size=16, tokenizer=tok
    )
    kept = {}
    for name in ("kvzip", "kvzip-global"):
        cache = source.compress(build_press(name, 0.75, replay_chunk=replay_chunk, **options))
        kept[name] = [None if layer.keys is None else layer.view()[2].clone() for layer in cache.layers]
    return {i: s.clone() for i, s in source.collector.reconstruction.items()}, kept


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
class MaskedReplay:
    """The replay's attention handed an explicit causal mask instead of ``is_causal`` (as for a cache whose layers
    need masks): exercises the masked CPU path."""

    def __init__(self, *args, **kwargs):
        import kvforge.presses.hooks as hooks_mod

        self.inner = hooks_mod.ReplayAttention(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name == "inner":
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def __call__(self, module, query, key, value, mask, is_causal, scaling, softcap):
        if is_causal and mask is None:
            q, k = query.shape[2], key.shape[2]
            mask, is_causal = torch.ones(q, k, dtype=torch.bool).tril(k - q)[None, None], False
        return self.inner(module, query, key, value, mask, is_causal, scaling, softcap)


@pytest.mark.parametrize("path", ["cpu-fused", "cpu-small-blocks", "cpu-masked", "explicit"])
@pytest.mark.parametrize("normalise", ["chunk", "all"])
@pytest.mark.parametrize("options", [{"replay_chunk": 40}, {"replay_chunk": 300}, {"replay_chunk": 0, "keep_first": 1}])
def test_fused_replay_scores_equal_the_textbook_attention(tok, arch, path, normalise, options, monkeypatch):
    """The replay scores inside the model's attention (no second pass): same scores and same kept entries as
    softmax(q k^T) written out, on both code paths (CPU kernel + log-sum-exp, explicit softmax)."""
    import kvforge.presses.hooks as hooks_mod

    model, ids = tiny_model(arch), chat_ids(tok, TEXT * 2)
    if path == "explicit":
        monkeypatch.setattr(hooks_mod, "_FLASH_WITH_LSE", None)
    elif path == "cpu-small-blocks":  # the score matmul in many blocks of keys / queries
        small_blocks = functools.partial(hooks_mod.ReplayAttention, max_elements=64)
        monkeypatch.setattr(replay_mod, "ReplayAttention", small_blocks)
    elif path == "cpu-masked":
        monkeypatch.setattr(replay_mod, "ReplayAttention", MaskedReplay)
    scores, kept = replay_scores_and_kept(model, tok, ids, normalise=normalise, **options)
    monkeypatch.setattr(replay_mod, "ReplayAttention", TextbookReplay)
    ref_scores, ref_kept = replay_scores_and_kept(model, tok, ids, normalise=normalise, **options)
    assert sorted(scores) == sorted(ref_scores) == compressible_layers(KVCache.for_model(model))
    for i in scores:
        torch.testing.assert_close(scores[i], ref_scores[i], rtol=1e-4, atol=1e-6)
    for name in kept:
        for a, b in zip(kept[name], ref_kept[name], strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_pool_keeps_the_neighbours_of_a_high_score():
    """pool=5: each entry scores the max of the 5 around it, so a needle's key words next to its surprising value
    are kept with it; pool=0 leaves the replay's scores as they are."""
    from kvforge.presses.kvzip import KVzipPress
    from kvforge.presses.layer import LayerContext

    keys = torch.zeros(1, 2, 100, 8)
    scores = torch.full((1, 2, 100), 0.01)
    scores[0, :, 50] = 0.9
    ctx = LayerContext(keys=keys, values=keys, positions=torch.arange(100)[None], reconstruction_scores=scores)
    plain = KVzipPress(0.9, keep_first=0, keep_header=False).score(ctx)
    pooled = KVzipPress(0.9, keep_first=0, keep_header=False, pool=5).score(ctx)
    assert (plain[0, 0] > 0.5).nonzero().flatten().tolist() == [50]
    assert (pooled[0, 0] > 0.5).nonzero().flatten().tolist() == [48, 49, 50, 51, 52]
    with pytest.raises(ValueError, match="odd"):
        KVzipPress(0.5, pool=4)


@pytest.mark.parametrize("budget", ["token", "tokens"])
def test_shared_token_budgets_keep_the_same_tokens_in_every_head(budget):
    """``token``: the same num_kept tokens in every KV head of a layer; ``tokens``: in every layer too; each token
    ranked by its highest score over those heads (and layers)."""
    from kvforge.presses.kvzip import shared_tokens
    from kvforge.presses.layer import num_kept

    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(1, 3, 40, generator=g) for _ in range(2)]
    scores[1][0, 2, 7] = 5.0  # one head of one layer wants token 7 badly
    groups = [[s] for s in scores] if budget == "token" else [scores]
    for group in groups:
        selections = shared_tokens(group, 0.75)
        k = num_kept(40, 0.75)
        kept = [sel.keep for sel in selections]
        assert all(int(m.sum(-1).min()) == int(m.sum(-1).max()) == k for m in kept)  # one count everywhere
        assert all(torch.equal(m[0, h], kept[0][0, 0]) for m in kept for h in range(3))  # the same tokens
        best = torch.stack([s.amax(dim=1) for s in group]).amax(dim=0)
        assert set(best[0].topk(k).indices.tolist()) == set(kept[0][0, 0].nonzero().flatten().tolist())
    if budget == "tokens":
        assert bool(kept[0][0, 0, 7])  # kept in the other layer too


def test_word_ids_join_digits_and_letters_and_split_at_spaces_and_marks(tok):
    from kvforge.presses.layer import MAX_WORD, word_ids

    ids = tok.encode("ab 47.x-y", add_special_tokens=False)
    assert word_ids(tok, ids).tolist() == [0, 0, 1, 1, 1, 2, 3, 4, 5]  # "ab", " 47", ".", "x", "-", "y"
    long = word_ids(tok, tok.encode("9" * (2 * MAX_WORD + 1), add_special_tokens=False))
    assert torch.bincount(long).tolist() == [MAX_WORD, MAX_WORD, 1]  # a run longer than a word is cut


def test_word_ids_read_sentencepiece_word_starts():
    """A SentencePiece decoder drops a piece's opening space when it decodes alone: its marker starts the word."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from kvforge.presses.layer import word_ids

    vocab = {"<unk>": 0, "\u2581the": 1, "\u2581code": 2, "\u2581is": 3, "\u25814": 4, "7": 5, "1": 6, ".": 7,
             "\u2581Ne": 8, "il": 9}  # fmt: skip
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    ids = [1, 2, 3, 4, 5, 6, 6, 7, 8, 9]
    assert tok.decode([2]) == "code"  # the space is gone when the piece decodes alone
    assert word_ids(tok, ids).tolist() == [0, 1, 2, 3, 3, 3, 3, 4, 5, 5]  # the / code / is / 4711 / . / Neil


def test_whole_words_keep_a_number_whole_in_the_heads_that_want_any_of_it():
    """Head 0 scores one digit of a 7-digit word high, head 1 another: with whole_words each head keeps all seven
    (and still keeps exactly its budget); without it each keeps its one digit."""
    from kvforge.presses.layer import word_max

    s = 60
    words = torch.tensor([i // 3 for i in range(20)] + [7] * 7 + [8 + i // 3 for i in range(s - 27)])
    assert int(words[20]) == 7 and int(words[27]) != 7
    scores = torch.rand(1, 2, s, generator=torch.Generator().manual_seed(0)) * 0.1 + 0.01
    scores[0, :, 20:27] = 0.0
    scores[0, 0, 22], scores[0, 1, 25] = 0.9, 0.8
    keys = torch.zeros(1, 2, s, 8)
    base = dict(keys=keys, values=keys, positions=torch.arange(s)[None], reconstruction_scores=scores, words=words)
    ctx = LayerContext(**base)
    ratio = 1 - 10 / s
    plain = KVzipPress(ratio, keep_first=0, keep_header=False, budget="head").compress(ctx).keep[0]
    whole = KVzipPress(ratio, keep_first=0, keep_header=False, budget="head", whole_words=True).compress(ctx).keep[0]
    number = slice(20, 27)
    assert plain[:, number].sum(-1).tolist() == [1, 1]
    assert whole[:, number].all()
    assert whole.sum(-1).tolist() == plain.sum(-1).tolist() == [num_kept(s, ratio)] * 2 == [10, 10]
    pooled = word_max(scores, words)
    assert torch.equal(pooled[0, 0, number], scores[0, 0, 22].expand(7))
    assert torch.equal(pooled[0, 1, number], scores[0, 1, 25].expand(7))
    with pytest.raises(ValueError, match="tokenizer"):
        KVzipPress(0.75, whole_words=True).score(LayerContext(**(base | {"words": None})))


def test_whole_words_through_compress_prefill_split_at_most_one_word_per_head(tok):
    """On a real prefill every KV head keeps each word of the context whole or drops it, except the one word the
    budget cuts (and the always-kept header and sinks, which follow no word)."""
    from kvforge.presses.layer import word_ids

    model = tiny_model("llama")
    ids = chat_ids(tok)
    cache = KVCache.for_model(model)
    compress_prefill(model, ids, cache, build_press("kvzip:budget=head:whole_words=true", 0.6), chunk_size=64,
                     tokenizer=tok)
    words = word_ids(tok, ids[0].tolist())
    header = header_length(tok, ids[0].tolist()) + 4
    for split in split_words(cache, words, header):
        assert len(split) <= 2, split  # the budget's cut, and the word the header's end falls in
    for layer in cache.layers:
        _, _, pos, valid = layer.view()
        for h in range(pos.shape[1]):
            kept = pos[0, h] if valid is None else pos[0, h][valid[0, h]]
            assert 0 < int((kept >= header).sum()) < len(words) - header


def test_words_are_read_only_for_presses_that_need_them(tok, monkeypatch):
    """The prompt's words are a declared need (``Needs.words``): read once per prefill for the presses that keep
    words whole, never for the others."""
    from kvforge.presses.apply import CompressionSource
    from kvforge.presses.layer import Needs

    calls = []
    real = apply_mod.word_ids
    monkeypatch.setattr(apply_mod, "word_ids", lambda *a: calls.append(1) or real(*a))
    model, ids = tiny_model("llama"), chat_ids(tok)
    whole, plain = build_press("kvzip:whole_words=true", 0.5), build_press("kvzip", 0.5)
    assert whole.needs().words and not plain.needs().words and plain.needs().merge(whole.needs()).words
    source = CompressionSource(model, ids, KVCache.for_model(model), Needs(reconstruction=True), tokenizer=tok)
    assert all(c.words is None for c in source.contexts(plain)) and not calls
    got = source.contexts(whole)
    assert all(c.words is not None and len(c.words) == ids.shape[1] for c in got)
    source.contexts(whole)
    assert len(calls) == 1
