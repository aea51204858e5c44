"""Ablation of semantic reuse's decision: what the learned verifier and each guard add.

Each row is one decider (:func:`kvforge.reuse.decide.build_decider`, the decision every entry point uses, with the
shipped calibration and no statistics yet): the verifier with the default guards, with each left out, with none and
with every guard; and the cosine similarity with every guard (the policy before the verifier) and with none. The
labelled pairs are decided: written near-miss pairs and the calibration side (what the verifier was trained and
calibrated on), and the evaluation side of the shared data and the hold-out near-miss kinds (never used to choose).
One markdown table on stdout, one JSON line per row in ``results/semantic/semantic_guards.jsonl``.

Then the curve of the verifier's decider over ``--curve`` max-error values (the certified threshold each gives):
evaluation-side hit rates against PAWS false-hit rates, with 95% Clopper-Pearson intervals (a table, and a figure
with ``--plot``), and what the verifier adds to a lookup (mean and 95th percentile over ``--latency`` pairs scored
one at a time, as a lookup does, on one torch thread).

    PYTHONPATH=src python benchmarks/semantic_guards.py --data-dir DATA --max-error 0.01 \
        --curve 0.002,0.005,0.01,0.02,0.05,0.1 --plot results/semantic/verifier_curve.png --latency 100
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from common import RESULTS

from kvforge.eval.semantic_pairs import load_pairs, rate, score_pairs
from kvforge.eval.semantic_report import decide_pairs
from kvforge.paths import cache_dir, default_data_dir
from kvforge.reuse.decide import VERIFIER_GUARDS, build_decider, default_verifier
from kvforge.reuse.embedder import MiniLMEmbedder
from kvforge.reuse.guards import DEFAULT_GUARDS
from kvforge.reuse.verifier import CrossVerifier

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
    parser.add_argument("--curve", default="", help="comma-separated max-error values of the curve")
    parser.add_argument("--plot", type=Path, default=None, help="write the curve's figure here")
    parser.add_argument("--latency", type=int, default=0, help="pairs to time the verifier on")
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
    (RESULTS / "semantic").mkdir(parents=True, exist_ok=True)
    with (RESULTS / "semantic" / "semantic_guards.jsonl").open("a") as out:
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
        if args.curve:
            points = curve(embedder, verifier, pairs, [float(x) for x in args.curve.split(",")])
            out.write(json.dumps({"bench": "semantic_curve", "points": points}) + "\n")
            if args.plot is not None:
                plot(points, args.plot)
        if args.latency:
            cost = latency(verifier, pairs, args.latency)
            print(f"verifier per lookup: mean {cost['mean_ms']:.1f} ms, p95 {cost['p95_ms']:.1f} ms "
                  f"({cost['n']} pairs, one at a time, 1 torch thread)")  # fmt: skip
            out.write(json.dumps({"bench": "semantic_verifier_latency", **cost}) + "\n")
    return 0


CURVE = (  # (label, source, same)
    ("PAWS non-paraphrase false hit", "paws", False),
    ("SQuAD paraphrase hit", "squad-paraphrase", True),
    ("PAWS paraphrase hit", "paws", True),
)


def curve(embedder: Any, verifier: Any, pairs: list[Any], deltas: list[float]) -> list[dict[str, Any]]:
    """Evaluation-side rates of the default decider at each max error (its certified verifier threshold)."""
    print("\n| max error | verifier threshold | " + " | ".join(c[0] + " (95% CI)" for c in CURVE) + " |")
    print("|---|---|" + "---|" * len(CURVE))
    points = []
    for delta in deltas:
        decider = build_decider(embedder, max_error=delta, verifier=verifier)  # the verifier with its default guards
        hits = decide_pairs(decider, pairs)
        t = decider.policy.threshold_for("", decider.guards, None)
        point: dict[str, Any] = {"max_error": delta, "threshold": t}
        for label, source, same in CURVE:
            chosen = [i for i, p in enumerate(pairs) if (p.source, p.side, p.same) == (source, "evaluation", same)]
            point[label] = rate(chosen, hits.__getitem__)
        points.append(point)
        cells = [f"{100 * point[c[0]]['rate']:.1f}% ({point[c[0]]['hits']}/{point[c[0]]['n']}; "
                 f"{100 * point[c[0]]['ci95'][0]:.1f}-{100 * point[c[0]]['ci95'][1]:.1f}%)" for c in CURVE]  # fmt: skip
        print(f"| {delta:g} | {point['threshold']:.3f} | " + " | ".join(cells) + " |", flush=True)
    return points


def plot(points: list[dict[str, Any]], path: Path) -> None:
    """Hit rates against the PAWS false-hit rate, with 95% intervals on both axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=90)
    fx = [100 * p[CURVE[0][0]]["rate"] for p in points]
    xerr = [[x - 100 * p[CURVE[0][0]]["ci95"][0] for x, p in zip(fx, points, strict=True)],
            [100 * p[CURVE[0][0]]["ci95"][1] - x for x, p in zip(fx, points, strict=True)]]  # fmt: skip
    for label, _, _ in CURVE[1:]:
        ys = [100 * p[label]["rate"] for p in points]
        yerr = [[y - 100 * p[label]["ci95"][0] for y, p in zip(ys, points, strict=True)],
                [100 * p[label]["ci95"][1] - y for y, p in zip(ys, points, strict=True)]]  # fmt: skip
        ax.errorbar(fx, ys, xerr=xerr, yerr=yerr, marker="o", capsize=3, label=label)
        for x, y, p in zip(fx, ys, points, strict=True):
            ax.annotate(f"{p['max_error']:g}", (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set(xlabel="PAWS non-paraphrase false hits (%)", ylabel="paraphrases served (%)",
           title="Verifier: hits against false hits (labels: max error)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def latency(verifier: Any, pairs: list[Any], n: int) -> dict[str, Any]:
    """Milliseconds the verifier adds to one lookup: ``n`` pairs not scored before, one at a time, one thread."""
    import time

    import numpy as np
    import torch

    fresh = CrossVerifier(verifier.embedder, verifier.name)  # an empty score cache
    fresh.score("warm up", "warm the model up")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    try:
        for p in pairs[:: max(len(pairs) // n, 1)][:n]:
            t0 = time.perf_counter()
            fresh.score(p.asked, p.stored)
            times.append(1000 * (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(threads)
    return {"n": len(times), "mean_ms": float(np.mean(times)), "p95_ms": float(np.percentile(times, 95))}


if __name__ == "__main__":
    sys.exit(main())
