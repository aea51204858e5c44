"""What each semantic guard adds on top of the bounded policy: false hits and hits with and without it.

For each guard set (all default guards; each one left out; none), the bounded policy's threshold is certified again
from the shipped calibration counts with that guard set (the counts keep every guard's verdict), floored at 0.9, and
the labelled pairs are decided: written near-miss pairs and the calibration side (what the choices were made on),
and the evaluation side of the shared data and the hold-out near-miss kinds (never used to choose). One markdown
table on stdout, one JSON line per guard set in ``benchmarks/results/semantic_guards.jsonl``.

    PYTHONPATH=src python benchmarks/semantic_guards.py --data-dir DATA --max-error 0.01
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvforge.eval.semantic_pairs import load_pairs, rate, score_pairs, served
from kvforge.paths import cache_dir, default_data_dir
from kvforge.reuse.embedder import MiniLMEmbedder
from kvforge.reuse.guards import DEFAULT_GUARDS
from kvforge.reuse.policy import BoundedErrorPolicy, shipped_prior

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--max-error", type=float, default=0.01)
    args = parser.parse_args(argv)
    embedder = MiniLMEmbedder()
    pairs = score_pairs(load_pairs(args.data_dir or default_data_dir()), embedder, cache_dir() / "semantic")
    policy = BoundedErrorPolicy(args.max_error, prior=shipped_prior(embedder.name))
    sets = {"all (default)": DEFAULT_GUARDS}
    sets |= {f"without {g}": tuple(x for x in DEFAULT_GUARDS if x != g) for g in DEFAULT_GUARDS}
    sets["none"] = ()
    print("| guards | threshold | " + " | ".join(c[0] for c in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / "semantic_guards.jsonl").open("a") as out:
        for name, guards in sets.items():
            t = policy.threshold_for("", guards, None)
            row = {"bench": "semantic_guards", "guards": name, "max_error": args.max_error, "threshold": t}
            cells = []
            for header, source, side, same in COLUMNS:
                chosen = [p for p in pairs if p.source == source and p.side == side and p.same == same]
                r = rate(chosen, lambda p, t=t, g=guards: served(p, t, g))
                row[header] = r
                cells.append("-" if not r["n"] else f"{100 * r['rate']:.1f}% ({r['hits']}/{r['n']})")
            print(f"| {name} | {t:.3f} | " + " | ".join(cells) + " |")
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
