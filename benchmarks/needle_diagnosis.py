"""Why a query-agnostic press loses a needle: evicted, or kept and not used?

For each example of a ``kvforge eval`` run folder (its ``examples.jsonl``; narrative or RULER needles), the context is
prefilled once (one KVzip replay shared by every variant) and compressed by each variant at ``--ratio``; the question
is then prefilled on top and answered greedily. Per variant the needle's entries are split into the **value** (the
answer's tokens), the **key** (the words the question repeats: names, places) and the rest, and for each part the
fraction of its (layer, KV head, token) entries kept is reported, as the harness's ``needle_kept`` averages them.

- ``oracle`` = the first variant with every entry of the needle sentence forced in (same budget: the lowest-scored
  other entries make room). If the oracle answers where the variant does not, the needle was lost to eviction; if the
  oracle fails too, the model cannot use the kept needle without the text around it (kept and not used).

    PYTHONPATH=src python benchmarks/needle_diagnosis.py runs/narr-pp/examples.jsonl --ratio 0.75 \\
        --variants kvzip kvzip-plus kvzip:pool=7 kvzip:pool=15 kvzap --out results/presses/needle_diagnosis.jsonl

One JSON line per (example, variant); a summary (answers, kept fractions per part) on stderr.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvforge.decode import DecodeState, decode
from kvforge.engine import Engine
from kvforge.eval.data import read_examples
from kvforge.eval.metrics import score_prediction
from kvforge.model import load_model
from kvforge.prefill import prefill
from kvforge.presses import CompressionSource, build_press
from kvforge.presses.base import Needs, Selection


def variant(spec: str, ratio: float) -> Any:
    """``kvzip:pool=7`` -> build_press("kvzip", ratio, pool=7)."""
    name, _, opts = spec.partition(":")
    options = {k: int(v) if v.isdigit() else v for k, v in (o.split("=") for o in opts.split(",") if o)}
    return build_press(name, ratio, **options)


class Forced:
    """A press whose selection forces ``positions`` in (every layer and head) at the inner press's budget."""

    def __init__(self, press: Any, positions: list[int]) -> None:
        self.press, self.positions = press, torch.tensor(positions)
        self.name, self.registry_name = "oracle", "oracle"

    def __getattr__(self, item: str) -> Any:
        return getattr(self.press, item)

    def compress_all(self, contexts: list[Any]) -> list[Selection]:
        selections = self.press.compress_all(contexts)
        out = []
        for ctx, sel in zip(contexts, selections, strict=True):
            want = torch.isin(ctx.positions[0], self.positions.to(ctx.positions.device))  # (S,)
            keep = sel.keep.clone()
            for h in range(keep.shape[1]):
                missing = want & ~keep[0, h]
                n = int(missing.sum())
                if n:
                    scores = self.press.score(ctx)[0, h].float().masked_fill(~keep[0, h] | want, float("inf"))
                    drop = scores.topk(n, largest=False).indices  # the lowest-scored kept entries make room
                    keep[0, h, drop] = False
                    keep[0, h] |= want
            out.append(Selection(keep=keep))
        return out


def token_spans(tok: Any, ids: list[int], text: str, needle: str, value: str, question: str) -> dict[str, list[int]]:
    """Positions of the needle's value tokens, key tokens (words also in the question) and the rest."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != ids:
        return {}
    start = text.find(needle)
    if start < 0:
        return {}
    v0 = start + needle.find(value)
    stop = {"what", "which", "when", "mentioned"}
    keys = {w.lower() for w in re.findall(r"[A-Za-z]+", question) if len(w) > 3} - stop
    parts: dict[str, list[int]] = defaultdict(list)
    for i, (a, b) in enumerate(enc["offset_mapping"]):
        if b <= start or a >= start + len(needle):
            continue
        word = text[a:b].strip().lower()
        if a < v0 + len(value) and b > v0:
            parts["value"].append(i)
        elif word and any(word in k or k in word for k in keys if len(word) > 2):
            parts["key"].append(i)
        else:
            parts["rest"].append(i)
    return dict(parts)


def kept(cache: Any, positions: list[int]) -> float | None:
    if not positions:
        return None
    want = torch.tensor(positions)
    fractions = []
    for layer, native in zip(cache.layers, cache.native_windows, strict=True):
        if native is not None:
            continue
        _, _, held, valid = layer.view()
        hit = held[..., None] == want
        if valid is not None:
            hit &= valid[..., None]
        fractions.append(hit.any(dim=2).float().mean(dim=-1).flatten())
    return float(torch.cat(fractions).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("examples", type=Path)
    p.add_argument("--ratio", type=float, default=0.75)
    p.add_argument("--variants", nargs="+", default=["kvzip", "kvzip-plus"])
    p.add_argument("--limit", type=int)
    p.add_argument("--threads", type=int)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m", device="cpu")
    engine = Engine(model, tok)
    examples = read_examples(args.examples, limit=args.limit)
    done = set()
    if args.out.exists():
        done = {(r["id"], r["variant"]) for r in map(json.loads, args.out.read_text().splitlines()) if r.strip()}
    presses = {spec: variant(spec, args.ratio) for spec in args.variants}
    needs = Needs()
    for press in presses.values():
        needs = needs.merge(press.needs())
    for ex in examples:
        names = ["full", *args.variants, "oracle"]
        if all((ex.id, n) in done for n in names):
            continue
        ctx, question = engine.encode_qa(ex.context, ex.question, system=ex.system, answer_prefix=ex.answer_prefix)
        text = tok.decode(ctx)
        parts = token_spans(tok, ctx, text, ex.needles[0], ex.answers[0], ex.question) if ex.needles else {}
        source = CompressionSource(model, ctx, engine.new_cache(), needs, tokenizer=tok)
        oracle = Forced(presses[args.variants[0]], sorted(i for v in parts.values() for i in v))
        for name in names:
            if (ex.id, name) in done:
                continue
            press = oracle if name == "oracle" else presses.get(name)
            cache = source.restore() if name == "full" else source.compress(press)
            logits = prefill(model, torch.tensor([question]), cache)
            out = decode(model, cache, logits, DecodeState(ex.max_new_tokens, eos_token_ids=engine.eos_token_ids))
            answer = tok.decode(out.token_ids)
            row = {"id": ex.id, "variant": name, "ratio": 0.0 if name == "full" else args.ratio,
                   "score": score_prediction(answer, ex.answers, ex.metric), "answer": answer[:60],
                   **{f"kept_{part}": kept(cache, pos) for part, pos in parts.items()},
                   "num_tokens": {part: len(pos) for part, pos in parts.items()}}  # fmt: skip
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            source.restore()
    rows = [json.loads(x) for x in args.out.read_text().splitlines() if x.strip()]
    full = {r["id"]: r["score"] for r in rows if r["variant"] == "full"}
    summary = defaultdict(lambda: defaultdict(list))
    for r in rows:
        for key in ("score", "kept_value", "kept_key", "kept_rest"):
            if r.get(key) is not None and (key != "score" or full.get(r["id"])):
                summary[r["variant"]][key].append(r[key])
    for name, cols in summary.items():
        print(name, {k: round(sum(v) / len(v), 3) for k, v in cols.items()}, f"n={len(cols['score'])}", file=sys.stderr)


if __name__ == "__main__":
    main()
