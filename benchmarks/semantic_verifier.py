"""Train the learned verifier of semantic reuse and make its calibration (what kvforge ships in
``kvforge/data/semantic/``: ``verifier-<name>.safetensors`` and ``prior-<name>.json``).

Only the calibration side of the shared data (``squad_paraphrase``, ``paws_wiki``, ``squad_v2_dev``; see
:mod:`kvforge.eval.semantic_pairs`) and the written near-miss kinds are read. They are split by group (a SQuAD
paragraph, a PAWS sentence group, a near-miss kind) into a training part (two thirds) and a calibration part (one
third): the verifier is fitted on the first (with the one-edit pairs :mod:`kvforge.reuse.verifier_train` makes from
its SQuAD questions); the second, which it never saw, gives the counts of its scores that the bounded policy
certifies its threshold from. The evaluation side and the hold-out near-miss kinds are never read. Deterministic:
the same data gives the same bytes. About 10 minutes on 2 CPU cores. Prints the certified thresholds.

    PYTHONPATH=src python benchmarks/semantic_verifier.py --data-dir DATA
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from kvforge.eval.semantic_pairs import calibrate, load_pairs, score_pairs, side_of
from kvforge.paths import cache_dir, default_data_dir
from kvforge.reuse.decide import VERIFIER_GUARDS
from kvforge.reuse.embedder import MiniLMEmbedder
from kvforge.reuse.policy import BoundedErrorPolicy, prior_path
from kvforge.reuse.verifier import (
    DEFAULT_VERIFIER,
    CrossEncoder,
    CrossVerifier,
    minilm_path,
    save_tensors,
    verifier_path,
)
from kvforge.reuse.verifier_train import part_of, synthetic_pairs, train_verifier


def squad_questions(data: Path, limit: int) -> list[str]:
    """Questions of the SQuAD paragraphs on the calibration side and in the training part (at most ``limit``)."""
    path = data / "squad_v2_dev" / "dev.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if side_of(row["context"]) == "calibration" and part_of(row["context"]) == "fit":
            out += [qa["question"].strip() for qa in row["qas"] if qa["question"].strip()]
    out = sorted(set(out))
    random.Random(0).shuffle(out)
    return sorted(out[:limit])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--name", default=DEFAULT_VERIFIER)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--questions", type=int, default=800, help="SQuAD questions the one-edit pairs come from")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: the packaged data folder")
    args = parser.parse_args(argv)
    data = args.data_dir or default_data_dir()
    pairs = [p for p in load_pairs(data, include_holdout=False) if p.side == "calibration"]
    if not any(p.source == "paws" for p in pairs):
        print(f"no shared data under {data}: refusing to train on the written pairs alone", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    embedder = MiniLMEmbedder()
    fit = [(p.stored, p.asked, p.same) for p in pairs if part_of(p.group) == "fit"]
    made = synthetic_pairs(squad_questions(data, args.questions))
    held = [p for p in pairs if part_of(p.group) == "calibration"]
    encoder = CrossEncoder(minilm_path(embedder))
    tensors = train_verifier(encoder, fit + made, epochs=args.epochs, progress=lambda m: print(m, flush=True))
    meta = {"trained_on": f"{len(fit)} labelled pairs (squad_paraphrase + paws_wiki calibration side, 2/3; near-miss) "
            f"+ {len(made)} one-edit pairs of SQuAD questions", "epochs": str(args.epochs)}  # fmt: skip
    out_dir = args.out_dir or verifier_path(args.name).parent
    save_tensors(tensors, out_dir / verifier_path(args.name).name, meta)
    verifier = CrossVerifier(embedder, name=args.name, tensors=tensors)
    score_pairs(held, embedder, cache_dir() / "semantic")  # cosine similarity and the guards' verdicts
    for p, s in zip(held, verifier.score_many([(p.asked, p.stored) for p in held]), strict=True):
        p.score = float(s)
    prior = calibrate(held, args.name, source=f"{len(held)} pairs the verifier was not trained on: squad_paraphrase "
                      "+ paws_wiki (calibration side, 1/3) + near-miss", score=True)  # fmt: skip
    (out_dir / prior_path(args.name).name).write_text(json.dumps(prior.to_json(), separators=(",", ":")) + "\n")
    wrong = sum(c for (w, _, _), c in prior.counts.items() if w)
    print(f"trained on {len(fit)} + {len(made)} pairs, calibrated on {len(held)} ({wrong} wrong) in "
          f"{time.perf_counter() - t0:.0f}s")  # fmt: skip
    for delta in (0.01, 0.05):
        policy = BoundedErrorPolicy(delta, prior=prior, min_similarity=0.0, population_floor=0.0)
        for guards in (VERIFIER_GUARDS, ()):
            print(f"max_error {delta}: guards {list(guards)} certify verifier score {policy.certified(guards, None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
