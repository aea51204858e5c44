"""Why CacheClip misses a multi-document needle: which tokens it recomputes, and what recomputing more would change.

For each `needle-docs` example of a `kvforge eval` run (its `examples.jsonl`), with the main model as its own
auxiliary at recompute ratio r: the share of the needle's tokens CacheClip selects, the percentile of the needle's
mean score among the context tokens, and the greedy answer when recomputing (a) CacheClip's selection, (b) the
selection + every needle token, (c) the needle tokens only, (d) the selection + the first 16 tokens of every chunk.
One JSON line per example on stdout.

    python benchmarks/rag_needle_diagnosis.py runs/rag/examples.jsonl --limit 5
"""

from __future__ import annotations

import argparse
import json

import torch

from kvforge.eval.data import read_examples
from kvforge.model import load_model
from kvforge.prefill import forward
from kvforge.rag import RagModel
from kvforge.rag.aux import select_top
from kvforge.rag.strategies import _run_selected, make_strategy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("examples", help="examples.jsonl of a kvforge eval run with needle-docs examples")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--recompute-ratio", type=float, default=0.2)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    rag = RagModel(model, tok)
    clip = make_strategy("cacheclip", args.recompute_ratio)
    examples = [e for e in read_examples(args.examples) if e.task == "needle-docs" and e.needles][: args.limit]

    def greedy(cache, logits) -> str:
        out, token = [], logits.argmax(-1, keepdim=True)
        for _ in range(args.max_new_tokens):
            out.append(int(token))
            token = forward(model, token, cache)[:, -1].argmax(-1, keepdim=True)
        return tok.decode(out, skip_special_tokens=True)

    for ex in examples:
        prompt = rag.build_prompt(ex.chunks, ex.question, system=ex.system, answer_prefix=ex.answer_prefix)
        clip.warm(rag, prompt)
        asm = rag.load(prompt)
        scores = clip._scorer(rag).score(prompt)
        chosen = select_top(scores, args.recompute_ratio)
        needle = torch.zeros(len(scores), dtype=torch.bool)
        heads = torch.zeros(len(scores), dtype=torch.bool)
        start = 0
        for text, ids, offsets in zip(prompt.chunk_texts, prompt.chunk_ids, prompt.chunk_offsets, strict=True):
            a = text.find(ex.needles[0])
            if a >= 0:
                b = a + len(ex.needles[0])
                for j, (x, y) in enumerate(offsets):
                    needle[start + j] |= y > a and x < b
            heads[start : start + 16] = True
            start += len(ids)
        answers = {}
        for name, sel in [("cacheclip", chosen), ("cacheclip+needle", chosen | needle), ("needle_only", needle),
                          ("cacheclip+chunk_heads16", chosen | heads)]:  # fmt: skip
            recompute = torch.zeros(asm.num_tokens, dtype=torch.bool)
            recompute[asm.context_idx[sel]] = True
            cache, logits = _run_selected(rag, asm, recompute)
            answers[name] = greedy(cache, logits)
        correct = {k: any(a in v for a in ex.answers) for k, v in answers.items()}
        row = {"id": ex.id, "answer": ex.answers, "needle_selected": float(chosen[needle].float().mean()),
               "needle_score_percentile": float((scores < scores[needle].mean()).float().mean()),
               "answers": answers, "correct": correct}  # fmt: skip
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
