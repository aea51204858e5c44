"""Make the calibration kvforge ships for semantic reuse's bounded policy (``kvforge/data/semantic/prior-*.json``).

Counts of (wrong or right, the guards refusing the pair, similarity bin) over the calibration side of the shared data
(``squad_paraphrase``, ``paws_wiki``; see :mod:`kvforge.eval.semantic_pairs`) and the written near-miss pairs; the
evaluation side and the hold-out near-miss kinds are never read. Prints the thresholds it certifies.

    PYTHONPATH=src python benchmarks/semantic_calibrate.py --data-dir DATA
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvforge.eval.semantic_pairs import calibrate, load_pairs, score_pairs
from kvforge.paths import cache_dir, default_data_dir
from kvforge.reuse.embedder import MiniLMEmbedder
from kvforge.reuse.guards import DEFAULT_GUARDS
from kvforge.reuse.policy import BoundedErrorPolicy, prior_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="default: the packaged prior of the embedder")
    args = parser.parse_args(argv)
    embedder = MiniLMEmbedder()
    data = args.data_dir or default_data_dir()
    pairs = [p for p in load_pairs(data, include_holdout=False) if p.side == "calibration"]
    if not any(p.source == "paws" for p in pairs):
        print(f"no shared data under {data}: refusing to calibrate on the written pairs alone", file=sys.stderr)
        return 1
    score_pairs(pairs, embedder, cache_dir() / "semantic")
    prior = calibrate(pairs, embedder.name, source="squad_paraphrase + paws_wiki (calibration side) + near_miss_dev")
    out = args.out or prior_path(embedder.name)
    out.write_text(json.dumps(prior.to_json(), separators=(",", ":")) + "\n")
    wrong = sum(c for (w, _, _), c in prior.counts.items() if w)
    print(f"wrote {out}: {len(pairs)} pairs, {wrong} wrong candidates")
    for delta in (0.01, 0.05):
        policy = BoundedErrorPolicy(delta, prior=prior, min_similarity=-1.0)
        for guards in (DEFAULT_GUARDS, ()):
            print(f"max_error {delta}: guards {list(guards)} certify threshold {policy.certified(guards, None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
