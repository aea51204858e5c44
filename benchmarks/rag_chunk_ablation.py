"""Which stale chunks break a multi-document needle: recompute one chunk, or every chunk but one.

For one `needle-docs` example of a `kvforge eval` run (its `examples.jsonl`), the log-probability of the answer's
first digit (after the leading space token) and the top-3 next tokens for: the full prefill, `naive` (every chunk
reused), `ape`, and for each chunk j >= 1, recomputing only chunk j, then recomputing every chunk but j (all at their
true positions). One JSON line per variant on stdout.

    python benchmarks/rag_chunk_ablation.py runs/rag_ratio/examples.jsonl --id needle-docs-L4096-d0.10-0
"""

from __future__ import annotations

import argparse
import json

import torch

from kvforge.cache import KVCache
from kvforge.engine import Engine
from kvforge.eval.data import read_examples
from kvforge.model import load_model
from kvforge.prefill import forward
from kvforge.request import Chunks, Encoded, Request
from kvforge.reuse.rag import ChunkReuse, RagPrompt, make_strategy
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
    ap.add_argument("--id", required=True, help="the example id")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    engine = Engine(model, tok)
    rag = ChunkReuse(model, tok, model_id=engine.model_id)
    found = [e for e in read_examples(args.examples) if e.id == args.id]
    if not found or not found[0].chunks:
        raise SystemExit(f"no example {args.id!r} with chunks in {args.examples}")
    ex = found[0]
    prompt = rag.build_prompt(ex.chunks, ex.question, system=ex.system, answer_prefix=ex.answer_prefix)
    answer = tok(" " + ex.answers[0], add_special_tokens=False).input_ids
    first, digit = answer[0], answer[1]  # a leading space token, then the first digit

    def report(name: str, cache: KVCache, logits: torch.Tensor) -> None:
        if int(logits.argmax(-1)) == first:
            logits = forward(model, torch.tensor([[first]], device=logits.device), cache)[:, -1]
            target = digit
        else:
            target = first
        logp = torch.log_softmax(logits.float()[0], -1).cpu()
        top = logp.topk(3)
        top3 = [[tok.decode([int(i)]), round(float(v), 3)] for v, i in zip(top.values, top.indices, strict=True)]
        row = {"variant": name, "answer_logprob": round(float(logp[target]), 3), "top3": top3,
               "answer_is_top1": int(top.indices[0]) == target}  # fmt: skip
        print(json.dumps(row), flush=True)

    def run(method: object) -> tuple[KVCache, torch.Tensor]:
        rag.method = method  # type: ignore[assignment]
        return prefilled(engine, rag, prompt)

    for name in ("full", "naive", "ape"):
        report(name, *run(make_strategy(name)))
    bounds = [0]
    for ids in prompt.chunk_ids:
        bounds.append(bounds[-1] + len(ids))
    for only in (True, False):
        for j in range(1, len(prompt.chunk_ids)):
            sel = torch.full((bounds[-1],), not only)
            sel[bounds[j] : bounds[j + 1]] = only
            report(f"{'only' if only else 'all but'} chunk {j}", *run(FixedSelection(sel)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
