"""Model load time: first load (GGUF dequantization) vs cached safetensors load, in fresh processes.

    python benchmarks/model_load.py --model smollm2-135m

Uses a temporary KVFORGE_CACHE_DIR so the first load really dequantizes. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CODE = (
    "import time; t=time.perf_counter(); from kvforge.model import load_model; s=time.perf_counter(); "
    "load_model({name!r}); e=time.perf_counter(); print(e-s, e-t)"
)


def timed_load(name: str, env: dict[str, str]) -> tuple[float, float]:
    """(seconds inside load_model, seconds including importing torch/transformers/kvforge) in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CODE.format(name=name)], env=env, capture_output=True, text=True,
                         check=True)
    call, total = out.stdout.strip().splitlines()[-1].split()
    return float(call), float(total)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, KVFORGE_CACHE_DIR=tmp)
        first = timed_load(args.model, env)
        second = timed_load(args.model, env)
    print(json.dumps({"bench": "model_load", "model": args.model, "first_load_s": round(first[0], 2),
                      "cached_load_s": round(second[0], 2), "cached_load_with_imports_s": round(second[1], 2)}))


if __name__ == "__main__":
    main()
