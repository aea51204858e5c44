"""EPIC's static recompute (LegoLink): the first tokens of each chunk run again, the rest reused.

All tokens recomputed is a full prefill, none is naive reuse (or APE's merge on the sequential layout), the budget is
exact and sits at the chunks' starts, the first chunk is exact as stored; the CLI and the evaluation select it.
"""

import json

import pytest
import torch
from rag_helpers import RagRunner

from kvforge.cli import main
from kvforge.errors import UserError
from kvforge.prefill import forward, prefill_at
from kvforge.reuse.rag import EPICStrategy, FixedSelection, make_strategy
from kvforge.reuse.rag.assemble import build_cache
from kvforge.reuse.rag.attend import APEAttention
from kvforge.reuse.rag.methods import head_counts
from kvforge.testing import tiny_model, tiny_tokenizer

DOCS = [
    "The cat sat on the mat, then it slept all day long.",
    "Paris is the capital of France. It is on the Seine.",
    "The code is 7731. Remember the code for later please.",
    "Rivers run to the sea and the sea is never full.",
]
QUESTION = "What is the code?"


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def rag(request):
    gemma = {"layer_types": ["sliding_attention", "full_attention", "full_attention"]}
    extra = gemma if request.param == "gemma3" else {}
    return RagRunner(tiny_model(request.param, num_hidden_layers=3, **extra), tiny_tokenizer())


@pytest.fixture(scope="module")
def prompt(rag):
    return rag.build_prompt(DOCS, QUESTION, system="Answer briefly.")


def _starts(prompt):
    """Prompt index of each chunk's first token (prefix, then chunk + separator after chunk)."""
    out, at = [], len(prompt.prefix_ids)
    for c in prompt.chunk_ids:
        out.append(at)
        at += len(c) + len(prompt.sep_ids)
    return out


def test_everything_recomputed_equals_full_prefill(rag, prompt):
    full = rag.prefill(prompt, make_strategy("full"))
    res = rag.prefill(prompt, make_strategy("epic", recompute_ratio=1.0))
    torch.testing.assert_close(res.logits, full.logits, atol=1e-4, rtol=0)
    assert res.num_recomputed == prompt.num_context_tokens
    nxt = int(full.logits.argmax())
    torch.testing.assert_close(forward(rag.model, [nxt], res.cache), forward(rag.model, [nxt], full.cache), atol=1e-4,
                               rtol=0)  # fmt: skip
    longest = max(map(len, prompt.chunk_ids))  # k >= every chunk: the same, through the per-chunk count
    res_k = rag.prefill(prompt, EPICStrategy(recompute_tokens=longest))
    first = len(prompt.chunk_ids[0])  # ... except the first chunk, which is exact as stored
    assert res_k.num_recomputed == prompt.num_context_tokens - first
    torch.testing.assert_close(res_k.logits, full.logits, atol=1e-4, rtol=0)


def test_nothing_recomputed_is_naive_and_ape_merge(rag, prompt):
    naive = rag.prefill(prompt, make_strategy("naive"))
    for epic in (EPICStrategy(recompute_tokens=0), make_strategy("epic", recompute_ratio=0.0)):
        res = rag.prefill(prompt, epic)
        torch.testing.assert_close(res.logits, naive.logits, atol=1e-5, rtol=0)
        assert res.num_recomputed == 0
    # epic-ape at 0: the sequential layout with APE's merge on the queries past the last chunk
    merged = rag.prefill(prompt, make_strategy("epic-ape", recompute_ratio=0.0))
    asm = rag.load(prompt)
    cache = build_cache(rag.model, asm, torch.zeros(asm.num_tokens, dtype=torch.bool))
    end = _starts(prompt)[-1] + len(prompt.chunk_ids[-1])  # positions are prompt indices here
    cache.attention_hook = APEAttention(cache, len(prompt.prefix_ids), end, 0.9, 0.9)
    ref = prefill_at(rag.model, asm.ids[asm.fresh_idx], asm.positions[asm.fresh_idx], cache)
    torch.testing.assert_close(merged.logits, ref, atol=1e-5, rtol=0)
    assert (merged.logits - naive.logits).abs().max() > 1e-4


def test_the_first_chunk_is_exact_as_stored(rag, prompt):
    """Recomputing the first chunk changes nothing: it follows the prefix exactly as when it was stored."""
    naive = rag.prefill(prompt, make_strategy("naive"))
    first = torch.zeros(prompt.num_context_tokens, dtype=torch.bool)
    first[: len(prompt.chunk_ids[0])] = True
    res = rag.prefill(prompt, FixedSelection(first))
    torch.testing.assert_close(res.logits, naive.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [1, 3, 1000])
def test_per_chunk_budget_sits_at_the_chunk_starts(rag, prompt, k):
    res = rag.prefill(prompt, EPICStrategy(recompute_tokens=k))
    starts = zip(prompt.chunk_ids[1:], _starts(prompt)[1:], strict=True)
    want = [i + j for c, i in starts for j in range(min(k, len(c)))]
    assert res.num_recomputed == len(want)
    asm = rag.load(prompt)
    recomputed = set(res.plan.prefill_positions) - {int(p) for p in asm.positions[asm.fresh_idx]}
    assert recomputed == set(want)  # positions = prompt indices in the sequential layout


@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.5, 0.9])
def test_share_budget_is_exact(rag, prompt, ratio):
    res = rag.prefill(prompt, make_strategy("epic", recompute_ratio=ratio))
    assert res.num_recomputed == round(ratio * prompt.num_context_tokens)
    assert res.plan.chunks.method == "epic"


def test_head_counts():
    assert head_counts([10, 10, 10], 7) == [3, 2, 2]
    assert head_counts([2, 10, 10], 12) == [2, 5, 5]
    assert head_counts([2, 3], 100) == [2, 3]
    assert head_counts([], 5) == [] and head_counts([4, 4], 0) == [0, 0]
    lengths = [5, 17, 1, 30, 9]
    for budget in range(sum(lengths) + 1):
        counts = head_counts(lengths, budget)
        assert sum(counts) == budget and all(0 <= c <= n for c, n in zip(counts, lengths, strict=True))
    epic = EPICStrategy(recompute_ratio=0.5)
    assert epic.counts([10, 10, 10]) == [0, 8, 7]  # the first chunk is exact: spent last
    assert EPICStrategy(recompute_ratio=0.9).counts([10, 10, 10]) == [7, 10, 10]
    assert EPICStrategy().counts([40, 40, 3]) == [0, 16, 3]  # default: 16 tokens per chunk


def test_bad_arguments():
    with pytest.raises(ValueError, match="not both"):
        EPICStrategy(recompute_tokens=4, recompute_ratio=0.1)
    with pytest.raises(ValueError, match="recompute_tokens"):
        EPICStrategy(recompute_tokens=-1)
    with pytest.raises(ValueError, match="recompute_ratio"):
        make_strategy("epic", recompute_ratio=1.5)
    with pytest.raises(ValueError, match="temperature"):
        EPICStrategy(temperature=0.0)


def test_cli_recompute_tokens(tiny_llama_dir, tmp_path, capsys):
    files = []
    for i, text in enumerate(["The code is 7731.", "Paris is in France.", "Cats sleep a lot."]):
        (f := tmp_path / f"d{i}.txt").write_text(text)
        files.append(str(f))
    argv = ["rag", "--model", str(tiny_llama_dir), "--docs", *files, "--question", "Code?", "--max-new-tokens", "2"]
    assert main([*argv, "--strategy", "epic", "--recompute-tokens", "2"]) == 0
    assert "strategy=epic " in (err := capsys.readouterr().err) and "recomputed=4 " in err  # 2 x the 2 later chunks
    for extra, message in (
        (["--strategy", "cacheblend", "--recompute-tokens", "2"], "only applies to --strategy epic"),
        (["--strategy", "epic", "--recompute-tokens", "2", "--recompute-ratio", "0.1"], "do not combine"),
        (["--strategy", "epic", "--recompute-tokens", "-1"], ">= 0"),
    ):
        assert main([*argv, *extra]) == 2  # refused before the model loads
        assert message in capsys.readouterr().err


def test_eval_rows(tiny_llama_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "e1", "chunks": ["The code is 12.", "Cats nap.", "Dogs bark."],
                                "question": "Code?", "answers": ["12"], "max_new_tokens": 2}) + "\n")  # fmt: skip
    out = tmp_path / "out"
    argv = ["eval", "--model", str(tiny_llama_dir), "--data", str(data), "--rag", "epic,epic-ape",
            "--recompute-ratios", "0.1,1.0", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rows = {(r["method"], r["compression_ratio"]): r for r in map(json.loads, (out / "results.jsonl").open())}
    assert set(rows) == {("full", 0.0), ("epic", 0.1), ("epic", 1.0), ("epic-ape", 0.1), ("epic-ape", 1.0)}
    assert rows[("epic", 1.0)]["prediction"] == rows[("full", 0.0)]["prediction"]
    assert rows[("epic", 0.1)]["info"]["method"] == "epic" and rows[("epic-ape", 0.1)]["info"]["temperature"] == 0.9


def test_unknown_option_is_a_user_error():
    with pytest.raises(UserError):
        from kvforge.names import check_rag_strategy

        check_rag_strategy("epic2")


def test_ape_merge_runs_the_other_queries_on_the_plain_kernel():
    """Queries before the contexts' end attend plainly (sdpa), the others with the merge: the same as all eager."""
    from types import SimpleNamespace

    from kvforge.cache import KVCache

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 12, 8, generator=gen), torch.randn(1, 2, 12, 8, generator=gen)
    pos = torch.arange(12)
    cache = KVCache(1)
    cache.layers[0].replace(k, v, pos[None])
    cache.query_positions = torch.tensor([[5, 6, 10, 11]])
    q = torch.randn(1, 4, 4, 8, generator=gen)
    mask = pos[None, None, None, :] <= cache.query_positions[:, None, :, None]  # (1, 1, Q, K)
    hook, module = APEAttention(cache, 2, 9, 0.8, 0.7), SimpleNamespace(layer_idx=0)
    fast = hook(module, q, k, v, mask, False, None, None)
    eager = hook._merged(module, q, k, v, mask, None, cache.query_positions)
    torch.testing.assert_close(fast, eager, atol=1e-5, rtol=0)
    plain = APEAttention(cache, 2, 9, 1.0, 1.0)._merged(module, q, k, v, mask, None, cache.query_positions)
    assert (fast[:, 2:] - plain[:, 2:]).abs().max() > 1e-3  # the merge really applies past the contexts
