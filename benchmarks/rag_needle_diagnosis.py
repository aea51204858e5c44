"""Why CacheClip misses a multi-document needle, and whether any choice of recomputed tokens would find it.

For each `needle-docs` example of a `kvforge eval` run (its `examples.jsonl`), with the main model as its own
auxiliary, the greedy answer when recomputing, at each recompute ratio r:

- `cacheclip`: CacheClip's selection (last-layer auxiliary attention, window grouping);
- `oracle_attention`: the top r context tokens by the attention the question pays them in the *full* prefill,
  averaged over all layers (what a perfect auxiliary model would see);
- `oracle_deviation`: the top r context tokens by how far their reused KV is from the full prefill's, relative
  squared error summed over layers, keys and values (what CacheBlend estimates from one layer);
- `oracle_product`: deviation x attention (stale *and* looked at);
- `tail`: the last r of the context (the tokens nearest the question);
- `cacheclip+needle`: CacheClip's selection plus every token of the needle sentence;

and, once per example, the needle's score percentile under CacheClip's scorer. The oracles need a full prefill, so
they are bounds, not methods: if no oracle finds the needle at r, no token-selection rule will. One JSON line per
example on stdout, then a summary line (correct answers per selection and ratio, and full's).

    python benchmarks/rag_needle_diagnosis.py runs/rag/examples.jsonl --ratios 0.2,0.3 --limit 10
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch

from kvforge.cache import KVCache
from kvforge.engine import Engine
from kvforge.eval.data import read_examples
from kvforge.model import load_model
from kvforge.prefill import forward, prefill
from kvforge.request import Chunks, Encoded, Request
from kvforge.reuse.rag import ChunkReuse, RagPrompt
from kvforge.reuse.rag.attend import AttentionCapture
from kvforge.reuse.rag.aux import AuxScorer, select_top
from kvforge.reuse.rag.methods import FixedSelection


def prefilled(engine: Engine, rag: ChunkReuse, prompt: RagPrompt) -> tuple[KVCache, torch.Tensor]:
    """The engine's cache and last logits for ``prompt`` planned by ``rag`` (a request that generates nothing)."""
    chunks = Chunks(prompt.chunk_texts, prompt.question, prompt.system, prompt.separator)
    encoded = Encoded(prompt.ids(), prompt.question, prompt)
    seq = engine.add(Request(chunks, 0, reuse=rag, encoded=encoded))
    engine.complete(seq)
    assert seq.logits is not None
    return seq.cache, seq.logits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("examples", help="examples.jsonl of a kvforge eval run with needle-docs examples")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--ratios", default="0.2", help="comma-separated recompute ratios")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",")]
    model, tok = load_model(args.model)
    engine = Engine(model, tok)
    rag = ChunkReuse(model, tok, model_id=engine.model_id)
    examples = [e for e in read_examples(args.examples) if e.task == "needle-docs" and e.needles][: args.limit]
    totals: Counter[str] = Counter()

    def greedy(cache: KVCache, logits: torch.Tensor) -> str:
        return engine.decode(cache, logits, args.max_new_tokens).text

    for ex in examples:
        prompt = rag.build_prompt(ex.chunks, ex.question, system=ex.system, answer_prefix=ex.answer_prefix)
        rag.warm(prompt)
        asm = rag.load(prompt)
        n, n_q = asm.num_tokens, len(prompt.question_ids)
        ctx_pos = asm.positions[asm.context_idx]

        # full prefill (the same ids); the question's attention captured on every layer
        full = KVCache.for_model(model)
        prefill(model, asm.ids[: n - n_q].tolist(), full, chunk_size=512)
        capture = AttentionCapture(full, range(len(full.layers)), int(asm.positions[n - n_q]))
        full.attention_hook = capture
        logits = forward(model, asm.ids[n - n_q :][None], full)[:, -1]
        full.attention_hook = None
        attention = capture.scores_by_position(n)[ctx_pos]
        deviation = torch.zeros(len(ctx_pos))
        in_cached = asm.is_context[asm.cached_idx]
        for li, layer in enumerate(full.layers):
            k, v, pos, _ = layer.view()
            assert torch.equal(pos[0, 0, : n - n_q].cpu(), asm.positions[: n - n_q])
            for fresh, reused in ((k[0][:, ctx_pos], asm.keys[li][:, in_cached]),
                                  (v[0][:, ctx_pos], asm.values[li][:, in_cached])):  # fmt: skip
                fresh, reused = fresh.float().cpu(), reused.float()
                deviation += (fresh - reused).pow(2).sum((0, 2)) / fresh.pow(2).sum((0, 2)).clamp_min(1e-12)
        answers = {"full": greedy(full, logits)}

        scores = AuxScorer(rag).score(prompt)  # CacheClip's scores, the model as its own auxiliary
        needle = torch.zeros(len(scores), dtype=torch.bool)
        start = 0
        for text, ids, offsets in zip(prompt.chunk_texts, prompt.chunk_ids, prompt.chunk_offsets, strict=True):
            a = text.find(ex.needles[0])
            if a >= 0:
                b = a + len(ex.needles[0])
                for j, (x, y) in enumerate(offsets):
                    needle[start + j] |= y > a and x < b
            start += len(ids)
        for r in ratios:
            tail = torch.zeros(len(scores), dtype=torch.bool)
            tail[len(scores) - round(r * len(scores)) :] = True
            chosen = select_top(scores, r)
            selections = {
                "cacheclip": chosen,
                "oracle_attention": select_top(attention, r, window_size=1),
                "oracle_deviation": select_top(deviation, r, window_size=1),
                "oracle_product": select_top(deviation * attention, r, window_size=1),
                "tail": tail,
                "cacheclip+needle": chosen | needle,
            }
            for name, sel in selections.items():
                rag.method = FixedSelection(sel)
                answers[f"{name}@{r:g}"] = greedy(*prefilled(engine, rag, prompt))
        correct = {k: any(a in v for a in ex.answers) for k, v in answers.items()}
        totals.update(k for k, ok in correct.items() if ok)
        percentile = float((scores < scores[needle].mean()).float().mean())
        row = {"id": ex.id, "answer": ex.answers, "needle_score_percentile": percentile, "answers": answers,
               "correct": correct}  # fmt: skip
        print(json.dumps(row), flush=True)
    names = ("cacheclip", "oracle_attention", "oracle_deviation", "oracle_product", "tail", "cacheclip+needle")
    keys = ["full"] + [f"{name}@{r:g}" for r in ratios for name in names]
    print(json.dumps({"summary": {k: f"{totals[k]}/{len(examples)}" for k in keys}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
