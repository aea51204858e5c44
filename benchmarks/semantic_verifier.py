"""Train the learned verifier of semantic reuse and make its calibration (what kvforge ships in
``kvforge/data/semantic/``: ``verifier-<name>.safetensors`` and ``prior-<name>.json``).

Only the calibration side of the shared data (``squad_paraphrase``, ``paws_wiki``; see
:mod:`kvforge.eval.semantic_pairs`) and the written near-miss kinds are read. They are split by group (a SQuAD
paragraph, a PAWS sentence group, a near-miss kind) into a training part (two thirds) and a calibration part (one
third): the verifier is fitted on the first; the second, which it never saw, gives the counts of its scores that the
bounded policy certifies its threshold from. The evaluation side and the hold-out near-miss kinds are never read.
Deterministic: the same data gives the same bytes. Prints the certified thresholds.

    PYTHONPATH=src python benchmarks/semantic_verifier.py --data-dir DATA
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from kvforge.eval.semantic_pairs import Pair, calibrate, load_pairs, score_pairs
from kvforge.paths import cache_dir, default_data_dir
from kvforge.reuse.decide import VERIFIER_GUARDS
from kvforge.reuse.embedder import MiniLMEmbedder
from kvforge.reuse.policy import BoundedErrorPolicy, prior_path
from kvforge.reuse.verifier import DEFAULT_VERIFIER, AlignmentVerifier, fit_weights, verifier_path


def part_of(pair: Pair) -> str:
    """``fit`` (two thirds of the groups) or ``calibration`` (the rest), by a hash of the pair's group."""
    digest = hashlib.sha256(f"verifier:{pair.group}".encode()).hexdigest()
    return "calibration" if int(digest[:8], 16) % 3 == 0 else "fit"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--name", default=DEFAULT_VERIFIER)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--weight-decay", type=float, default=1e-2)
    parser.add_argument("--out-dir", type=Path, default=None, help="default: the packaged data folder")
    args = parser.parse_args(argv)
    data = args.data_dir or default_data_dir()
    pairs = [p for p in load_pairs(data, include_holdout=False) if p.side == "calibration"]
    if not any(p.source == "paws" for p in pairs):
        print(f"no shared data under {data}: refusing to train on the written pairs alone", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    embedder = MiniLMEmbedder()
    verifier = AlignmentVerifier(embedder, name=args.name, weights=None)
    fit = [p for p in pairs if part_of(p) == "fit"]
    held = [p for p in pairs if part_of(p) == "calibration"]
    x = verifier.features([(p.asked, p.stored) for p in fit])
    weights = fit_weights(x, np.array([p.same for p in fit], np.float64), args.hidden, args.weight_decay)
    weights.meta["trained_on"] = f"{len(fit)} pairs: squad_paraphrase + paws_wiki (calibration side, 2/3), near-miss"
    out_dir = args.out_dir or verifier_path(args.name).parent
    weights.save(out_dir / verifier_path(args.name).name)
    verifier.weights = weights
    score_pairs(held, embedder, cache_dir() / "semantic")  # cosine similarity and the guards' verdicts
    scores = verifier.score_many([(p.asked, p.stored) for p in held])
    for p, s in zip(held, scores, strict=True):
        p.score = float(s)
    prior = calibrate(held, args.name, source=f"{len(held)} pairs the verifier was not trained on: squad_paraphrase "
                      "+ paws_wiki (calibration side, 1/3) + near_miss_dev", score=True)  # fmt: skip
    (out_dir / prior_path(args.name).name).write_text(json.dumps(prior.to_json(), separators=(",", ":")) + "\n")
    wrong = sum(c for (w, _, _), c in prior.counts.items() if w)
    print(f"trained on {len(fit)} pairs, calibrated on {len(held)} ({wrong} wrong) in {time.perf_counter() - t0:.0f}s")
    for delta in (0.01, 0.05):
        policy = BoundedErrorPolicy(delta, prior=prior, min_similarity=0.0, population_floor=0.0)
        for guards in (VERIFIER_GUARDS, ()):
            print(f"max_error {delta}: guards {list(guards)} certify verifier score {policy.certified(guards, None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
