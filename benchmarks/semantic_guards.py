"""Ablation of semantic reuse's decision: what the learned verifier and each guard add.

Each row is one decider (:func:`kvforge.reuse.decide.build_decider`, the decision every entry point uses, with the
shipped calibration and no statistics yet): the verifier with the default guards, with each left out, with none and
with every guard; and the cosine similarity with every guard (the policy before the verifier) and with none. The
labelled pairs are decided: written near-miss pairs and the calibration side (what the verifier was trained and
calibrated on), and the evaluation side of the shared data and the hold-out near-miss kinds (never used to choose).
One markdown table on stdout, one JSON line per row in ``benchmarks/results/semantic_guards.jsonl``.

    PYTHONPATH=src python benchmarks/semantic_guards.py --data-dir DATA --max-error 0.01
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvforge.eval.semantic_pairs import load_pairs, rate, score_pairs
from kvforge.eval.semantic_report import decide_pairs
from kvforge.paths import cache_dir, default_data_dir
from kvforge.reuse.decide import VERIFIER_GUARDS, build_decider, default_verifier
from kvforge.reuse.embedder import MiniLMEmbedder
from kvforge.reuse.guards import DEFAULT_GUARDS

RESULTS = Path(__file__).parent / "results"
COLUMNS = (  # (header, source, side, same)
    ("written near-miss false hit", "near-miss", "calibration", False),
    ("PAWS non-para. false hit (cal.)", "paws", "calibration", False),
    ("PAWS non-para. false hit (eval.)", "paws", "evaluation", False),
    ("same-paragraph false hit (eval.)", "squad-same-paragraph", "evaluation", False),
    ("hold-out 1 near-miss false hit", "near-miss-holdout", "evaluation", False),
    ("hold-out 2 near-miss false hit", "near-miss-holdout-2", "evaluation", False),
    ("hold-out 3 near-miss false hit", "near-miss-holdout-3", "evaluation", False),
    ("hold-out 4 near-miss false hit", "near-miss-holdout-4", "evaluation", False),
    ("written paraphrase hit", "near-miss", "calibration", True),
    ("SQuAD paraphrase hit (eval.)", "squad-paraphrase", "evaluation", True),
    ("PAWS paraphrase hit (eval.)", "paws", "evaluation", True),
)


def rows(verifier: Any) -> dict[str, dict[str, Any]]:
    """Name -> build_decider options of each row (``verifier``: the shipped one, shared by the rows)."""
    out: dict[str, dict[str, Any]] = {"verifier + default guards": {}}
    out |= {f"verifier without {g}": {"guards": tuple(x for x in VERIFIER_GUARDS if x != g)} for g in VERIFIER_GUARDS}
    out["verifier, no guard"] = {"guards": ()}
    out["verifier + every guard"] = {"guards": DEFAULT_GUARDS}
    for options in out.values():
        options["verifier"] = verifier
    out["cosine + every guard (no verifier)"] = {"verifier": None}
    out["cosine, no guard (no verifier)"] = {"verifier": None, "guards": ()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--max-error", type=float, default=0.01)
    args = parser.parse_args(argv)
    embedder = MiniLMEmbedder()
    pairs = score_pairs(load_pairs(args.data_dir or default_data_dir()), embedder, cache_dir() / "semantic")
    verifier = default_verifier(embedder)
    if verifier is None:
        print("no verifier is shipped for the embedder", file=sys.stderr)
        return 1
    verifier.cache_size = len(pairs)  # every pair scored once for all rows
    print("| decider | threshold | " + " | ".join(c[0] for c in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / "semantic_guards.jsonl").open("a") as out:
        for name, options in rows(verifier).items():
            decider = build_decider(embedder, max_error=args.max_error, **options)
            t = decider.policy.threshold_for("", decider.guards, None)
            hits = decide_pairs(decider, pairs)
            row = {"bench": "semantic_guards", "decider": name, "max_error": args.max_error, "threshold": t,
                   "scorer": decider.scorer, "guards": list(decider.guards)}  # fmt: skip
            cells = []
            for header, source, side, same in COLUMNS:
                chosen = [i for i, p in enumerate(pairs) if p.source == source and p.side == side and p.same == same]
                r = rate(chosen, hits.__getitem__)
                row[header] = r
                cells.append("-" if not r["n"] else f"{100 * r['rate']:.1f}% ({r['hits']}/{r['n']})")
            print(f"| {name} | {decider.scorer} >= {t:.3f} | " + " | ".join(cells) + " |", flush=True)
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
