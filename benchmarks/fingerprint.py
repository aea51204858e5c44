"""Weight digest of model_fingerprint: hashing every tensor (``hash_tensors=True``, and what kvforge did for every
model but the built-in fp32 ones) vs the digests of the model's files, cold (first read) and warm (cached by path,
size and mtime). One JSON line on stdout, appended to ``benchmarks/results/fingerprint.jsonl``; the best of
``--repeats`` runs each, in one process.

    OMP_NUM_THREADS=1 python benchmarks/fingerprint.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from kvforge.digests import folder_digest
    from kvforge.model import load_model, model_fingerprint, weights_digest

    model, tokenizer = load_model(args.model, device="cpu", dtype="float32")
    folder = model.config._name_or_path
    row: dict[str, Any] = {"bench": "fingerprint", "model": args.model}
    row["tensor_hash_fp32_s"] = best_of(lambda: weights_digest(model), args.repeats)
    with tempfile.TemporaryDirectory() as tmp:  # an empty digest cache for the cold runs
        os.environ["KVFORGE_CACHE_DIR"] = tmp

        def cold() -> None:
            shutil.rmtree(os.path.join(tmp, "digests"), ignore_errors=True)
            folder_digest(folder)

        row["file_digests_cold_s"] = best_of(cold, args.repeats)
        row["file_digests_warm_s"] = best_of(lambda: folder_digest(folder), args.repeats)

    def fingerprint(hash_tensors: bool) -> None:
        model.__dict__.pop("_kvforge_fingerprint", None)  # no cached answer
        model_fingerprint(model, tokenizer, hash_tensors=hash_tensors)

    row["model_fingerprint_tensors_s"] = best_of(lambda: fingerprint(True), args.repeats)
    row["model_fingerprint_files_s"] = best_of(lambda: fingerprint(False), args.repeats)
    line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    print(line)
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "fingerprint.jsonl", "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
