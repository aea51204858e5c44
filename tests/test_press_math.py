"""Press math on hand-made LayerContexts: no model needed."""

from __future__ import annotations

import pytest
import torch

from kvforge.presses import (
    AdaKVPress,
    CriticalAdaKVPress,
    CriticalKVPress,
    ExpectedAttentionPress,
    H2OPress,
    KnormPress,
    KVzipHeadPress,
    KVzipPress,
    LayerContext,
    PyramidKVPress,
    SnapKVPress,
    StreamingLLMPress,
    SurrogateKVPress,
    num_kept,
)
from kvforge.presses.pyramidkv import pyramid_budgets
from kvforge.presses.surrogatekv import choose_victims

H_KV, H, D, HIDDEN = 2, 4, 8, 32


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is faster


def make_ctx(s: int, seed: int = 0, w: int = 16, start: int = 0, layer_idx: int = 0, num_layers: int = 1):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, H_KV, s, D, generator=g) * 2
    values = torch.randn(1, H_KV, s, D, generator=g)
    positions = torch.arange(start, start + s)[None]
    w = min(w, s)
    return LayerContext(
        keys=keys,
        values=values,
        positions=positions,
        layer_idx=layer_idx,
        num_layers=num_layers,
        num_heads=H,
        window_queries=torch.randn(1, H, w, D, generator=g) * 2,
        window_positions=positions[:, -w:],
        output_weight=torch.randn(HIDDEN, H * D, generator=g),
        reconstruction_scores=torch.rand(1, H, s, generator=g),
        query_mean=torch.randn(1, H, D, generator=g),
        query_cov=(lambda a: a @ a.transpose(-1, -2) / D)(torch.randn(1, H, D, D, generator=g)),
        rope_angles=10000.0 ** (-torch.arange(D // 2) * 2.0 / D),
    )


def test_num_kept_matches_kvpress_convention():
    assert num_kept(100, 0.75) == 25
    assert num_kept(10, 0.7) == 3  # no float drift
    assert num_kept(7, 0.0) == 7
    assert num_kept(3, 0.99) == 1  # never empty
    assert num_kept(0, 0.5) == 0


UNIFORM = [
    lambda r: StreamingLLMPress(compression_ratio=r),
    lambda r: H2OPress(compression_ratio=r, window_size=16),
    lambda r: SnapKVPress(compression_ratio=r, window_size=16),
    lambda r: CriticalKVPress(press=SnapKVPress(compression_ratio=r, window_size=16)),
    lambda r: SurrogateKVPress(compression_ratio=r, surrogate="local"),
    lambda r: SurrogateKVPress(compression_ratio=r, surrogate="global", value_aware=True),
    lambda r: SurrogateKVPress(compression_ratio=r, surrogate="global", scores="kvzip"),
    lambda r: KnormPress(compression_ratio=r),
    lambda r: ExpectedAttentionPress(compression_ratio=r),
    lambda r: KVzipPress(compression_ratio=r, budget="head"),
]


@pytest.mark.parametrize("make", UNIFORM)
@pytest.mark.parametrize("s", [37, 130, 257])
@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.75, 0.9])
def test_uniform_presses_keep_exact_count_per_head(make, s, ratio):
    sel = make(ratio).compress(make_ctx(s))
    assert sel.keep.shape == (1, H_KV, s)
    assert sel.keep.sum(-1).tolist() == [[num_kept(s, ratio)] * H_KV]


HEADWISE = [
    lambda r: AdaKVPress(press=SnapKVPress(compression_ratio=r, window_size=16)),
    lambda r: CriticalAdaKVPress(press=SnapKVPress(compression_ratio=r, window_size=16)),
    lambda r: SurrogateKVPress(compression_ratio=r, headwise=True),
    lambda r: KVzipPress(compression_ratio=r),
    lambda r: KVzipPress(compression_ratio=r, value_aware=True),
    lambda r: KVzipHeadPress(compression_ratio=r, head_scores=[[1.0, 3.0]]),
]


@pytest.mark.parametrize("ratio", [0.3, 0.75])
def test_head_budget_is_per_head_through_compress_all(ratio):
    """What the press pipeline calls (``compress_all`` over the layers) keeps the "head" budget's promise too."""
    press = KVzipPress(compression_ratio=ratio, budget="head")
    for sel, s in zip(press.compress_all([make_ctx(130, seed=1), make_ctx(257, seed=2)]), [130, 257], strict=True):
        assert sel.keep.sum(-1).tolist() == [[num_kept(s, ratio)] * H_KV]


@pytest.mark.parametrize("make", HEADWISE)
@pytest.mark.parametrize("s", [64, 200, 333])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.8])
def test_headwise_presses_keep_exact_layer_total(make, s, ratio):
    totals, varied = [], False
    for seed in range(3):
        keep = make(ratio).compress(make_ctx(s, seed=seed)).keep
        counts = keep.sum(-1)[0]
        totals.append(int(counts.sum()))
        varied |= bool(counts[0] != counts[1])
    assert totals == [H_KV * num_kept(s, ratio)] * 3
    assert varied  # the point of head-adaptive budgets: heads get different counts


def test_streaming_llm_keeps_sinks_and_recent():
    keep = StreamingLLMPress(compression_ratio=0.75, num_sink=4).compress(make_ctx(100)).keep[0, 0]
    assert keep.nonzero().flatten().tolist() == [0, 1, 2, 3, *range(79, 100)]


def test_streaming_llm_sinks_are_absolute_positions():
    # new entries after a reused prefix: positions 50.. contain no sink, only the newest are kept
    keep = StreamingLLMPress(compression_ratio=0.5).compress(make_ctx(20, start=50)).keep[0, 0]
    assert keep.nonzero().flatten().tolist() == list(range(10, 20))


def test_snapkv_keeps_window_and_top_scores():
    ctx = make_ctx(120, w=16)
    press = SnapKVPress(compression_ratio=0.6, window_size=16)
    keep = press.compress(ctx).keep
    assert keep[..., -16:].all()
    scores = press.attention_scores(ctx)[..., :-16]
    for h in range(H_KV):
        kept, dropped = scores[0, h][keep[0, h, :-16]], scores[0, h][~keep[0, h, :-16]]
        assert kept.min() >= dropped.max()


def test_window_attention_matches_dense_softmax():
    ctx = make_ctx(40, w=8)
    probs = ctx.attention(ctx.window_queries, ctx.window_positions)  # (1, H, 8, 40)
    keys = ctx.keys.repeat_interleave(2, dim=1)
    logits = ctx.window_queries @ keys.transpose(-1, -2) / D**0.5
    causal = torch.arange(40)[None, :] <= torch.arange(32, 40)[:, None]
    ref = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(probs, ref)
    assert torch.allclose(probs.sum(-1), torch.ones(1, H, 8))


def test_prefix_enters_softmax_normalisation():
    ctx = make_ctx(30, start=10, w=8)
    ctx.prefix_keys = torch.randn(1, H_KV, 10, D)
    ctx.prefix_positions = torch.arange(10)[None, None].expand(1, H_KV, 10)
    ctx.prefix_valid = torch.ones(1, H_KV, 10, dtype=torch.bool)
    ctx.prefix_valid[0, 1, 3] = False  # padding of a head-wise prefix is not attended
    probs = ctx.attention(ctx.window_queries, ctx.window_positions)  # (1, H, 8, 30)
    keys = torch.cat([ctx.prefix_keys, ctx.keys], dim=2).repeat_interleave(2, dim=1)
    logits = ctx.window_queries @ keys.transpose(-1, -2) / D**0.5  # (1, H, 8, 40)
    visible = (torch.arange(40)[None, :] <= torch.arange(32, 40)[:, None])[None, None].repeat(1, H, 1, 1)
    visible[:, 2:4, :, 3] = False  # KV head 1 = query heads 2, 3
    ref = logits.masked_fill(~visible, float("-inf")).softmax(-1)[..., 10:]
    torch.testing.assert_close(probs, ref)


def test_pyramid_budgets_decrease_and_keep_total():
    for s, r, layers in [(2000, 0.5, 30), (1000, 0.3, 7), (3000, 0.5, 12)]:
        budgets = pyramid_budgets(s, r, layers, 64, 20.0)
        assert sum(budgets) == layers * num_kept(s, r)
        assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    assert pyramid_budgets(2000, 0.75, 30, 64, 20.0) == [500] * 30  # kvpress's SnapKV fallback


def test_pyramidkv_layer_counts_follow_budgets():
    s, r, layers = 400, 0.5, 4
    budgets = pyramid_budgets(s, r, layers, 16, 20.0)
    for i in range(layers):
        keep = PyramidKVPress(compression_ratio=r, window_size=16).compress(make_ctx(s, layer_idx=i, num_layers=layers))
        assert keep.keep.sum(-1).tolist() == [[budgets[i]] * H_KV]


def test_criticalkv_first_stage_is_attention_top():
    ctx = make_ctx(150)
    inner = SnapKVPress(compression_ratio=0.5, window_size=16)
    keep = CriticalKVPress(press=inner).compress(ctx).keep
    n1 = int(num_kept(150, 0.5) * 0.5)
    top = inner.score(ctx).topk(n1, dim=-1).indices
    assert keep.gather(-1, top).all()


@pytest.mark.parametrize("kind", ["null", "local", "global"])
def test_surrogates_equal_the_means_they_claim(kind):
    ctx = make_ctx(200)
    press = SurrogateKVPress(compression_ratio=0.5, surrogate=kind)
    sel = press.compress(ctx)
    victims = choose_victims(press.token_scores(ctx)[0], 200 - num_kept(200, 0.5), 32, 8)
    assert victims
    union = torch.cat([m for _, m in victims])
    for _, members in victims:
        slot = int(members[-1])
        assert sel.keep[0, :, slot].all() and not sel.keep[0, :, members[:-1]].any()
        for h in range(H_KV):
            if kind == "null":
                want_k, want_v = torch.zeros(D), torch.zeros(D)
            elif kind == "local":
                want_k, want_v = ctx.keys[0, h, members].mean(0), ctx.values[0, h, members].mean(0)
            else:
                want_k, want_v = ctx.keys[0, h, union].mean(0), ctx.values[0, h, union].mean(0)
            torch.testing.assert_close(sel.keys[0, h, slot], want_k)
            torch.testing.assert_close(sel.values[0, h, slot], want_v)
    untouched = sel.keep[0, 0].clone()
    untouched[[int(m[-1]) for _, m in victims]] = False
    assert torch.equal(sel.keys[0, :, untouched], ctx.keys[0, :, untouched])  # kept originals unchanged
    assert sel.keep[..., -8:].all()  # recent suffix kept


def test_surrogate_victims_are_lowest_chunks():
    scores = torch.ones(1, 8 + 32 * 4)
    scores[0, 32:64] = 0.1  # chunk 1 is the least important
    scores[0, 96:128] = 0.2  # then chunk 3
    victims = choose_victims(scores, 31 + 5, 32, 8)
    assert [int(m[0]) // 32 for _, m in victims] == [1, 3]
    assert torch.equal(victims[0][1], torch.arange(32, 64)) and bool((victims[1][1] // 32 == 3).all())
    assert len(victims[0][1]) == 32 and len(victims[1][1]) == 6  # last victim merges only what is needed


def test_surrogatekv_kvzip_scores_protect_header_and_sinks():
    # KVzip's replay never repeats the template header, so it scores it 0 beyond the sinks: SurrogateKV on those
    # scores merged the system prompt first (the needle was lost at 50% kept); the header and sinks are protected
    ctx = make_ctx(400)
    ctx.reconstruction_scores = 0.5 + torch.rand(1, H, 400, generator=torch.Generator().manual_seed(1))
    ctx.reconstruction_scores[..., 2:40] = 0.0  # header of 36 + 4 sinks, as the replay leaves it (sinks scored)
    ctx.header_length = 36
    for ratio in (0.5, 0.75):
        press = SurrogateKVPress(compression_ratio=ratio, scores="kvzip")
        sel = press.compress(ctx)
        assert sel.keep[0, :, :40].all()  # header + first 4 kept
        assert torch.equal(sel.keys[0, :, :40], ctx.keys[0, :, :40])  # and not overwritten by a surrogate
        assert sel.keep.sum(-1).tolist() == [[num_kept(400, ratio)] * H_KV]  # still exact
    sel = SurrogateKVPress(compression_ratio=0.98, scores="kvzip").compress(ctx)  # 8 kept: less than the header
    assert sel.keep.sum(-1).tolist() == [[num_kept(400, 0.98)] * H_KV]


def test_surrogatekv_extreme_ratio_still_exact():
    keep = SurrogateKVPress(compression_ratio=0.98).compress(make_ctx(100)).keep
    assert keep.sum(-1).tolist() == [[num_kept(100, 0.98)] * H_KV]


def test_invalid_options_raise():
    with pytest.raises(ValueError):
        SnapKVPress(compression_ratio=1.0)
    with pytest.raises(ValueError):
        SurrogateKVPress(surrogate="median")
    with pytest.raises(ValueError):
        AdaKVPress(press=AdaKVPress(press=SnapKVPress()))  # type: ignore[arg-type]


def test_projected_value_norms_match_explicit_heads():
    from kvforge.presses.criticalkv import projected_value_norms

    ctx = make_ctx(50)
    w = ctx.output_weight  # (hidden, H * D)
    want = torch.zeros(1, H_KV, 50)
    for h in range(H):
        v = ctx.values[0, h // (H // H_KV)]  # (S, D) of the head's KV group
        want[0, h // (H // H_KV)] += (v @ w[:, h * D : (h + 1) * D].t()).abs().sum(-1) / (H // H_KV)
    torch.testing.assert_close(projected_value_norms(ctx), want)


def test_value_norm_bounds_hold_per_token():
    from kvforge.presses.criticalkv import _grouped_output_weight, projected_value_norms, value_norm_bounds

    ctx = make_ctx(120, seed=3)
    exact = projected_value_norms(ctx)
    lower, upper = value_norm_bounds(ctx, _grouped_output_weight(ctx))
    assert bool((lower <= exact).all()) and bool((exact <= upper).all())


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.75, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pruned_critical_selection_equals_computing_every_norm(ratio, seed):
    from kvforge.presses.adakv import adaptive_budgets
    from kvforge.presses.criticalkv import critical_select, critical_select_pruned, projected_value_norms

    ctx = make_ctx(300, seed=seed)
    scores = SnapKVPress(compression_ratio=ratio, window_size=16).score(ctx)
    n = num_kept(300, ratio)
    uniform = torch.full(scores.shape[:2], n, dtype=torch.long)
    _, varying = adaptive_budgets(scores, n, 0.2)  # AdaKV: budgets differ per head
    for budgets in (uniform, varying):
        want = critical_select(scores, projected_value_norms(ctx), budgets, 0.5, 1e-4)
        got = critical_select_pruned(scores, ctx, budgets, 0.5, 1e-4)
        assert torch.equal(got, want)
        assert got.sum(-1).tolist() == budgets.tolist()
