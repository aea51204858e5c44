"""Cross-check kvforge's KVzip replay scores against NVIDIA kvpress 0.5.5's KVzipPress on the same context ids.

    PYTHONPATH=src python benchmarks/kvzip_crosscheck.py --tokens 1000 --threads 1

kvpress runs in the side venv (default ~/kvpress-venv, see kvpress_side_by_side.py); this script re-runs itself
there (``--kvpress-side``) and records kvpress's per-(layer, KV head, token) scores (``score_val`` before its global
top-k) and its pruned entries. Then kvforge replays the same context with each KVzip variant and prints one JSON line
per variant: the largest score difference relative to the layer's largest score, over the context entries kvpress
scores (after the template header; kvpress gives the header 0 and keeps only 4 sinks), and the overlap of the kept
context entries at ``--ratio`` with kvforge's ``budget="global"`` selection (|ours & theirs| / |theirs|).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
VENV = Path.home() / "kvpress-venv"
VARIANTS = {  # label -> KVzipPress options
    "default (chunk softmax, turn continued)": {},
    "default, keep_header=False (kvpress's protection: 4 sinks)": {"keep_header": False},
    "softmax over all keys": {"normalise": "all"},
    "new user turn, all keys (before)": {"normalise": "all", "replay_turn": "new"},
}


def kvpress_side(ids_path: str, out_path: str, ratio: float) -> None:
    import kvpress.presses.kvzip_press as kvzip_mod
    from press_crosscheck import gguf_model
    from transformers import AutoTokenizer, DynamicCache

    model = gguf_model()
    model.set_attn_implementation("sdpa")
    tok = AutoTokenizer.from_pretrained(model.config.name_or_path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")

    class _Tok:  # kvpress's KVzip loads the tokenizer by name; the GGUF folder needs gguf_file
        @staticmethod
        def from_pretrained(*args: Any, **kwargs: Any) -> Any:
            return tok

    kvzip_mod.AutoTokenizer = _Tok
    press = kvzip_mod.KVzipPress(compression_ratio=ratio)
    got: dict[str, Any] = {}
    original = press.compress_post

    def capture(model: Any) -> None:
        got["scores"] = press.score_val[:, 0].float().tolist()  # (L, H_kv, S) before the sinks are forced
        got["prefix"] = press.prefix_length
        original(model)
        got["pruned"] = [
            [list(map(int, t)) for t in layer.self_attn.masked_key_indices[1:]] for layer in model.model.layers
        ]

    press.compress_post = capture
    ids = torch.tensor([json.loads(Path(ids_path).read_text())])
    with torch.inference_mode(), press(model):
        model.model(input_ids=ids, past_key_values=DynamicCache(), cache_position=torch.arange(ids.shape[1]))
    Path(out_path).write_text(json.dumps(got))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--venv", type=Path, default=VENV)
    ap.add_argument("--kvpress-side", nargs=2, metavar=("IDS_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kvpress_side:
        kvpress_side(*args.kvpress_side, args.ratio)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from press_needle import load_smollm2, needle_case

    from kvforge.cache import KVCache
    from kvforge.presses import CompressionSource, Needs, build_press

    model, tok = load_smollm2()
    ids, _, _ = needle_case(tok, seed=0, num_tokens=args.tokens, depth=0.5)  # context only (query-agnostic)
    with tempfile.TemporaryDirectory() as tmp:
        ids_path, out_path = Path(tmp) / "ids.json", Path(tmp) / "out.json"
        ids_path.write_text(json.dumps(ids))
        cmd = [str(args.venv / "bin" / "python"), __file__, "--kvpress-side", str(ids_path), str(out_path),
               "--ratio", str(args.ratio), "--threads", str(args.threads or torch.get_num_threads())]  # fmt: skip
        subprocess.run(cmd, check=True)
        theirs = json.loads(out_path.read_text())
    ref = torch.tensor(theirs["scores"])  # (L, H_kv, S)
    start = theirs["prefix"]
    dropped = {(layer, h, t) for layer, (hs, ts) in enumerate(theirs["pruned"]) for h, t in zip(hs, ts, strict=True)}
    their_kept = {
        (l_, h, t) for l_ in range(ref.shape[0]) for h in range(ref.shape[1]) for t in range(start, ref.shape[2])
    }
    their_kept -= dropped
    source = CompressionSource(model, [ids], KVCache.for_model(model), Needs(reconstruction=True), tokenizer=tok)
    for label, options in VARIANTS.items():
        press = build_press("kvzip-global", args.ratio, **options)
        cache = source.compress(press)
        ours = torch.stack([
            source.collector.reconstruction[i].view(1, ref.shape[1], -1, ref.shape[2]).amax(2)[0]
            for i in range(ref.shape[0])
        ])  # fmt: skip
        diff = (ours[..., start:] - ref[..., start:]).abs().amax(-1) / ref[..., start:].abs().amax(-1)
        kept = set()
        for layer_idx, layer in enumerate(cache.layers):
            _, _, positions, valid = layer.view()
            for h in range(positions.shape[1]):
                pos = positions[0, h] if valid is None else positions[0, h][valid[0, h]]
                kept |= {(layer_idx, h, int(t)) for t in pos if int(t) >= start}
        row = {"variant": label, "options": options, "tokens": len(ids), "ratio": args.ratio, "header": start,
               "max_rel_score_diff": round(float(diff.max()), 6), "mean_rel_score_diff": round(float(diff.mean()), 6),
               "kept_overlap": round(len(kept & their_kept) / max(1, len(their_kept)), 4)}  # fmt: skip
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
