"""Normalised score against stored bytes for store-once rows of several needle sets, one panel per set.

    S=results/store_once
    python benchmarks/plot_frontier_sets.py --out $S/frontier_sets.png --max-fraction 6 \
        "RULER, seeds 0-3=$S/frontier_ruler_results.jsonl,$S/frontier_options_ruler_results.jsonl" \
        "RULER, seeds 4-5 (held out)=$S/frontier_heldout_ruler_results.jsonl" ...

Each set is ``label=file[,file...]``: ``kvforge eval --store-once`` rows (``results.jsonl``, or rows of several runs
with a ``run`` column naming each). A question is keyed by its run and id; normalised = 100 x the method's summed
score / the full cache's over the set's questions; a method found in several files is pooled over them (so give
each question once per method); answered = of the questions the full cache answers, those the method answers too.
Prints, per set and pooled over the sets, stored fraction, normalised score, answered and mean KL.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import astuple, dataclass
from pathlib import Path


@dataclass
class Point:
    """One method on one set: sums over its questions (so that sets pool by adding)."""

    n: int = 0
    fraction: float = 0.0  # summed stored fraction
    score: float = 0.0
    full_score: float = 0.0
    answered: int = 0  # of the questions the full cache answers, those this method answers too
    full_answered: int = 0
    kl: float = 0.0

    def __add__(self, other: Point) -> Point:
        return Point(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def line(self) -> str:
        return (f"{100 * self.fraction / self.n:5.2f}%  normalised {100 * self.score / self.full_score:6.1f}  "
                f"answered {self.answered} of {self.full_answered}  KL {self.kl / self.n:.3f}  ({self.n} questions)")


def points(files: list[Path]) -> dict[str, Point]:
    """method -> its :class:`Point` over the questions of ``files``."""
    full: dict[tuple[str, str], float] = {}
    rows: dict[str, dict[tuple[str, str], dict]] = defaultdict(dict)
    for path in files:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            key = (f"{path}:{r.get('run', '')}", r["id"])
            if r["method"] == "full":
                full[key] = float(r["score"])
            elif r["method"].startswith("stored-") and r.get("stored_fraction"):
                rows[r["method"].removeprefix("stored-")][key] = r
    out = {}
    for method, got in rows.items():
        point = Point()
        for key, r in got.items():
            point += Point(1, r["stored_fraction"], r["score"], full[key], int(full[key] > 0 and r["score"] > 0),
                           int(full[key] > 0), r.get("kl") or 0.0)  # fmt: skip
        out[method] = point
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sets", nargs="+", help="label=file[,file...]")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-fraction", type=float, default=6.0, help="leave out points above this %% of fp16")
    parser.add_argument("--methods", nargs="*", help="only these methods (as in the rows, without stored-)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [spec.partition("=") for spec in args.sets]
    sets = [(label, points([Path(f) for f in files.split(",")])) for label, _, files in parts]
    methods = sorted({m for _, got in sets for m, p in got.items() if 100 * p.fraction / p.n <= args.max_fraction and
                      (not args.methods or m in args.methods)})  # fmt: skip
    colours = {m: plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")(i) for i, m in enumerate(methods)}
    cols = min(2, len(sets))
    rows = (len(sets) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), sharey=True, squeeze=False)
    for ax, (label, got) in zip(axes.flat, sets, strict=False):
        print(f"## {label}")
        for method, point in sorted(got.items(), key=lambda kv: kv[1].fraction / kv[1].n):
            if method not in colours:
                continue
            print(f"{method:34} {point.line()}")
            ax.scatter(100 * point.fraction / point.n, 100 * point.score / point.full_score, s=30,
                       color=colours[method], label=method)  # fmt: skip
        ax.axvline(5.0, color="grey", lw=0.8, ls="--")
        ax.axhline(95.0, color="grey", lw=0.8, ls="--")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("stored bytes, % of the fp16 full cache")
        ax.set_ylabel("normalised score (full cache = 100)")
        ax.grid(alpha=0.3)
    print("## all sets pooled (methods in every set)")
    for method in methods:
        if all(method in got for _, got in sets):
            print(f"{method:34} {sum((got[method] for _, got in sets), Point()).line()}")
    for ax in list(axes.flat)[len(sets):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], marker="o", ls="", color=colours[m], label=m) for m in methods]
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(methods)), fontsize=8)
    fig.tight_layout(rect=(0, 0.04 * ((len(methods) + 3) // 4), 1, 1))
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
