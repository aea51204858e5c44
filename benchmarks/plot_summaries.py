"""Normalised score and KL against the share of the context kept, for presses from several ``summary.csv`` files.

    R=results/presses
    python benchmarks/plot_summaries.py $R/qa4k_summary.csv $R/qa4k_kvzap_summary.csv \
        --methods kvzip-plus kvzip kvzip-head kvzap --out $R/qa4k_kvzap_vs_replay.png

Rows are ``kvforge eval`` pooled summaries (``eval_merge.py --pool``); a method found in several files is taken from
the last one.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("summaries", nargs="+", type=Path)
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    points: dict[str, dict[float, tuple[float, float]]] = {}
    for path in args.summaries:
        with path.open() as f:
            for row in csv.DictReader(f):
                if row["method"] in args.methods and float(row["compression_ratio"]) > 0:
                    kept = round(100 * (1 - float(row["compression_ratio"])))
                    points.setdefault(row["method"], {})[kept] = (float(row["normalized"]), float(row["kl"]))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method in args.methods:
        got = sorted(points.get(method, {}).items())
        if not got:
            raise SystemExit(f"no rows of {method!r} in {', '.join(map(str, args.summaries))}")
        kept = [k for k, _ in got]
        left.plot(kept, [v[0] for _, v in got], marker="o", label=method)
        right.plot(kept, [v[1] for _, v in got], marker="o", label=method)
    left.set(xlabel="context kept (%)", ylabel="normalised score (full cache = 100)")
    right.set(xlabel="context kept (%)", ylabel="KL(full || press), nats per answer token", yscale="log")
    left.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
