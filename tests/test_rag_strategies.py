"""RAG strategies: r = 1 is a full prefill, r = 0 is naive reuse, budgets are exact, APE's merge is APE's."""

import math

import pytest
import torch
from rag_helpers import RagRunner

from kvforge.cache import KVCache
from kvforge.prefill import forward, kv_through, prefill_at
from kvforge.reuse.rag import STRATEGIES, APEStrategy, CacheBlendStrategy, CacheClipStrategy, ChunkReuse, make_strategy
from kvforge.reuse.rag.attend import APEAttention
from kvforge.testing import tiny_model, tiny_tokenizer

ARCHS = ["llama", "qwen2", "mistral", "gemma3"]
DOCS = [
    "The cat sat on the mat, then it slept all day long.",
    "Paris is the capital of France. It is on the Seine.",
    "The code is 7731. Remember the code for later please.",
]
QUESTION = "What is the code?"


@pytest.fixture(scope="module", params=ARCHS)
def rag(request):
    # 3 layers so CacheBlend's check layer 1 is not the last one (later layers really reuse)
    model = tiny_model(
        request.param,
        num_hidden_layers=3,
        **(
            {"layer_types": ["sliding_attention", "full_attention", "full_attention"]}
            if request.param == "gemma3"
            else {}
        ),
    )
    return RagRunner(model, tiny_tokenizer())


@pytest.fixture(scope="module")
def prompt(rag):
    return rag.build_prompt(DOCS, QUESTION, system="Answer briefly.")


@pytest.fixture(scope="module")
def full(rag, prompt):
    return rag.prefill(prompt, make_strategy("full"))


def _run(rag, prompt, name, **kwargs):
    return rag.run(prompt, name, **kwargs)


def test_registry_names():
    assert set(STRATEGIES) == {"full", "naive", "ape", "cacheblend", "cacheclip", "epic", "epic-ape",
                               "cacheclip-windows", "cacheclip-tokens", "cacheclip-l8"}


@pytest.mark.parametrize("name", ["cacheblend", "cacheclip"])
def test_full_recompute_equals_full_prefill(rag, prompt, name):
    full = rag.prefill(prompt, make_strategy("full"))  # its cache is extended below: not the shared fixture
    res = _run(rag, prompt, name, recompute_ratio=1.0)
    torch.testing.assert_close(res.logits, full.logits, atol=1e-4, rtol=0)
    assert res.num_recomputed == prompt.num_context_tokens and res.num_tokens == len(prompt.ids())
    # the assembled cache decodes like the full one
    nxt = int(full.logits.argmax())
    a = forward(rag.model, [nxt], res.cache)
    b = forward(rag.model, [nxt], full.cache)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    for la, lb in zip(res.cache.layers, full.cache.layers, strict=True):
        assert torch.equal(la.view()[2], lb.view()[2])  # same positions, same order


def test_cacheclip_at_zero_is_naive(rag, prompt, full):
    naive = _run(rag, prompt, "naive")
    clip = _run(rag, prompt, "cacheclip", recompute_ratio=0.0)
    torch.testing.assert_close(clip.logits, naive.logits, atol=1e-5, rtol=0)
    assert naive.num_recomputed == 0 and naive.num_reused == len(prompt.prefix_ids) + prompt.num_context_tokens
    assert naive.num_fresh == len(prompt.question_ids) + len(prompt.sep_ids) * len(DOCS)
    assert (naive.logits - full.logits).abs().max() > 1e-3  # reuse without recompute is an approximation


@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5])
def test_recompute_budget_is_exact(rag, prompt, ratio):
    n_ctx = prompt.num_context_tokens
    blend = _run(rag, prompt, "cacheblend", recompute_ratio=ratio)
    assert blend.num_recomputed == round(ratio * n_ctx)
    clip = rag.prefill(prompt, CacheClipStrategy(recompute_ratio=ratio, window_size=1))
    assert clip.num_recomputed == round(ratio * n_ctx)
    grouped = _run(rag, prompt, "cacheclip", recompute_ratio=ratio)
    assert round(ratio * n_ctx) <= grouped.num_recomputed <= n_ctx


def test_more_recompute_gets_closer_to_full(rag, prompt, full):
    errs = [
        float((_run(rag, prompt, "cacheblend", recompute_ratio=r).logits - full.logits).abs().max()) for r in (0.0, 1.0)
    ]
    assert errs[1] < 1e-4 < errs[0]


def test_cacheblend_picks_largest_key_deviation(rag, prompt):
    """With the check layer = last layer everything is fresh there, so any ratio gives full-prefill logits."""
    last = rag.num_layers - 1
    full = rag.prefill(prompt, make_strategy("full"))
    res = rag.prefill(prompt, CacheBlendStrategy(recompute_ratio=0.2, check_layer=last))
    torch.testing.assert_close(res.logits, full.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("check", [0, 1])
def test_check_pass_stops_after_the_check_layer_with_the_same_entries(rag, prompt, check):
    """CacheBlend's check pass stops once the check layer's KV is written: the entries of layers <= check equal those
    of a pass through the whole model, the later layers stay unwritten, and the layers after it never run."""
    from kvforge.reuse.rag.assemble import build_cache

    asm = rag.load(prompt)
    rest = torch.arange(asm.prefix_len, asm.num_tokens)
    whole = build_cache(rag.model, asm, asm.is_context)
    prefill_at(rag.model, asm.ids[rest], asm.positions[rest], whole, chunk_size=7)
    ran: list[int] = []
    hooks = [
        layer.mlp.register_forward_hook(lambda *_, i=i: ran.append(i)) for i, layer in enumerate(rag.model.model.layers)
    ]
    try:
        stopped = build_cache(rag.model, asm, asm.is_context)
        kv_through(rag.model, asm.ids[rest], asm.positions[rest], stopped, check, chunk_size=7)
    finally:
        for h in hooks:
            h.remove()
    assert set(ran) == set(range(check)) and stopped.stop_after is None
    for li in range(check + 1):
        k, v, pos, _ = stopped.layers[li].view()
        k_ref, v_ref, pos_ref, _ = whole.layers[li].view()
        assert torch.equal(pos, pos_ref)
        torch.testing.assert_close(k, k_ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(v, v_ref, atol=1e-6, rtol=0)
    k_later, _, _, _ = stopped.layers[check + 1].view()
    assert not bool(k_later[:, :, rest].abs().sum()), "a layer after the check layer was written"
    assert stopped.next_position == whole.next_position


def test_ape_with_unit_temperature_and_scale_is_plain_attention(rag, prompt):
    """T = S = 1 leaves attention unchanged: same logits as the APE layout with the standard attention."""
    one = _run(rag, prompt, "ape", temperature=1.0, scale=1.0)
    asm = rag.load(prompt, ape=True)
    from kvforge.reuse.rag.assemble import build_cache

    cache = build_cache(rag.model, asm, torch.zeros(asm.num_tokens, dtype=torch.bool))
    plain = prefill_at(rag.model, asm.ids[asm.fresh_idx], asm.positions[asm.fresh_idx], cache)
    torch.testing.assert_close(one.logits, plain, atol=1e-5, rtol=0)
    default = _run(rag, prompt, "ape")
    assert (default.logits - plain).abs().max() > 1e-4
    # APE positions: every chunk starts right after the prefix, the question after the longest chunk
    p = len(prompt.prefix_ids)
    assert int(asm.positions[p]) == p and int(asm.positions[p + len(prompt.chunk_ids[0])]) == p
    assert int(asm.positions.max()) + 1 == p + max(map(len, prompt.chunk_ids)) + len(prompt.sep_ids) + len(
        prompt.question_ids
    )


def test_ape_merge_formula():
    """One adjusted softmax == APE's two attentions merged with weights softmax([S T lse_C, lse_O])."""
    torch.manual_seed(0)
    cache = KVCache(1)
    ctx_pos, other_pos = [3, 4, 5, 3, 4], [0, 1, 2, 6, 7]
    pos = torch.tensor(other_pos[:3] + ctx_pos + other_pos[3:])
    k, v = torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
    cache.layers[0].replace(k, v, pos[None])
    q = torch.randn(1, 2, 1, 8)
    cache.query_positions = torch.tensor([[8]])
    t, s = 0.7, 0.8
    module = type("M", (), {"layer_idx": 0})()
    out = APEAttention(cache, 3, 6, t, s)(module, q, k, v, None, False, 1 / math.sqrt(8), None)  # (1, 1, 2, 8)
    is_ctx = (pos >= 3) & (pos < 6)
    kk, vv = k[0, 0], v[0, 0]
    for h in range(2):
        scores = q[0, h, 0] @ kk.T / math.sqrt(8)
        sc, so = scores[is_ctx] / t, scores[~is_ctx]
        out_c, out_o = torch.softmax(sc, 0) @ vv[is_ctx], torch.softmax(so, 0) @ vv[~is_ctx]
        w = torch.softmax(torch.stack([s * t * torch.logsumexp(sc, 0), torch.logsumexp(so, 0)]), 0)
        torch.testing.assert_close(out[0, 0, h], w[0] * out_c + w[1] * out_o, atol=1e-5, rtol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown RAG strategy"):
        make_strategy("blend")
    with pytest.raises(ValueError, match="recompute_ratio"):
        CacheClipStrategy(recompute_ratio=1.5)
    with pytest.raises(ValueError, match="temperature"):
        APEStrategy(temperature=0.0)


def test_engine_answers_over_chunks_and_reports_reuse(rag):
    reuse = ChunkReuse(rag.model, rag.tokenizer, method="cacheclip", recompute_ratio=0.25)
    gen = rag.engine.answer_chunks(DOCS, QUESTION, rag=reuse, max_new_tokens=3)
    assert gen.reuse is not None and gen.reuse.chunks is not None
    facts = gen.reuse.chunks
    assert gen.reuse.kind == "chunks" and facts.method == "cacheclip" and facts.chunk_misses == len(DOCS)
    assert gen.reused_tokens == gen.reuse.reused_tokens > 0 and facts.recomputed_tokens > 0
    assert gen.prompt_tokens == gen.reused_tokens + facts.recomputed_tokens + facts.fresh_tokens
    assert len(gen.token_ids) <= 3 and gen.ttft_s > 0
    again = rag.engine.answer_chunks(DOCS, QUESTION, rag=reuse, max_new_tokens=3)
    assert again.reuse.chunks.chunk_misses == 0 and again.token_ids == gen.token_ids


def test_engine_chunk_answer_at_full_recompute_equals_plain_generation(rag):
    """r = 1 through the whole engine loop (plan -> recompute unit -> decode) answers like a plain prefill."""
    reuse = ChunkReuse(rag.model, rag.tokenizer, method="cacheclip", recompute_ratio=1.0)
    prompt = reuse.build_prompt(DOCS, QUESTION)
    gen = rag.engine.answer_chunks(DOCS, QUESTION, rag=reuse, max_new_tokens=5)
    plain = rag.engine.generate(prompt.ids(), max_new_tokens=5)
    assert gen.token_ids == plain.token_ids


def test_chunk_reuse_needs_chunks(rag):
    from kvforge.engine import Engine
    from kvforge.errors import UserError

    reuse = ChunkReuse(rag.model, rag.tokenizer)
    with pytest.raises(UserError, match="chunks"):
        reuse.plan([1, 2, 3])
    with pytest.raises(UserError, match="chunk reuse"):
        rag.engine.answer_chunks(DOCS, QUESTION)  # the engine has no chunk strategy
    with pytest.raises(UserError, match="Chunks"):  # a chunk strategy cannot answer a plain prompt
        Engine(rag.model, rag.tokenizer, reuse=reuse).generate("Hello there", max_new_tokens=2)
