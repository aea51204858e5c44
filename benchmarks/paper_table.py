"""The papers' comparison table from a `kvforge eval` run: task families pooled, normalised score and KL by budget.

`kvforge eval`'s own summary reports every task separately (RULER's five sub-tasks have 2-3 examples each at
4k on a CPU budget); this script pools them into the three families the issue names (needle / RULER mix /
LongBench-style QA), computes per family the normalised score on the pooled examples (100 x mean score / mean
full-cache score on the same examples) and the mean fidelity columns, and writes a Markdown table, JSON lines and a
plot per quantity (``paper_comparison.png``: normalised score per family; ``paper_comparison_kl.png``: KL per family
and over the families; never both quantities on one figure):

    python benchmarks/paper_table.py runs/repro --out results/eval_repro
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvforge.eval.report import pivot_table

FULL = "full"


def family(task: str) -> str:
    return "ruler" if task.startswith("ruler") else task


def pooled(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (family, method, compression ratio) with the family in ``task`` (so the report's pivot table
    formats them), plus task "all" (the families' unweighted mean)."""
    full = {r["id"]: r for r in rows if r["method"] == FULL}
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["id"] in full:
            groups[(family(r["task"]), r["method"], float(r["compression_ratio"]))].append(r)
    out = []
    for (fam, method, ratio), group in sorted(groups.items()):
        ref = sum(full[r["id"]]["score"] for r in group) / len(group)
        score = sum(r["score"] for r in group) / len(group)
        row = {"task": fam, "method": method, "compression_ratio": ratio, "n": len(group),
               "score": 100 * score, "normalized": 100 * score / ref if ref > 0 else None}  # fmt: skip
        for col in ("kl", "top1_agreement", "needle_kept", "kept_ratio", "ttft_s"):
            vals = [r[col] for r in group if r.get(col) is not None]
            row[col] = sum(vals) / len(vals) if vals else None
        out.append(row)
    by: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in out:
        by[(r["method"], r["compression_ratio"])].append(r)
    for (method, ratio), group in by.items():
        row = {"task": "all", "method": method, "compression_ratio": ratio, "n": sum(r["n"] for r in group)}
        for col in ("normalized", "kl", "top1_agreement"):
            vals = [r[col] for r in group if r.get(col) is not None]
            row[col] = sum(vals) / len(vals) if vals else None
        out.append(row)
    return out


def plot(rows: list[dict[str, Any]], families: list[str], path: Path, title: str, column: str = "normalized") -> None:
    """One panel per family of one quantity (``normalized`` or ``kl``, the latter with an "all" panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvforge.eval.report import _color

    methods = sorted({r["method"] for r in rows if r["method"] != FULL})
    panels = families if column == "normalized" else [*families, "all"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.3 * len(panels), 4.2), dpi=80, squeeze=False)
    for ax, fam in zip(axes.flat, panels, strict=True):
        for i, m in enumerate(methods):
            pts = sorted((100 * (1 - r["compression_ratio"]), r[column]) for r in rows
                         if r["task"] == fam and r["method"] == m and r.get(column) is not None)  # fmt: skip
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="osD^v<>ph*"[i % 10], linestyle="-" if i < 10 else "--",
                        color=_color(i), label=m, markersize=5)  # fmt: skip
        n = max((r["n"] for r in rows if r["task"] == fam and r["method"] == FULL), default=0)
        if column == "normalized":
            ax.axhline(100, color="black", linestyle="--", linewidth=1)
            ax.set(ylabel="score (full cache = 100)", title=f"{fam} (n={n})")
        else:
            label = "mean over the families" if fam == "all" else f"{fam} (n={n})"
            ax.set(ylabel="KL(full || method), nats/token", title=label)
        ax.set(xlabel="remaining cache (%)")
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=7, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a kvforge eval --out folder")
    ap.add_argument("--out", type=Path, help="write paper_table.md, paper_table.jsonl, paper_comparison.png here")
    args = ap.parse_args()
    rows = [json.loads(line) for line in (args.run / "results.jsonl").read_text().splitlines() if line.strip()]
    summary = pooled(rows)
    families = sorted({r["task"] for r in summary} - {"all"})
    n = {f: max(r["n"] for r in summary if r["task"] == f and r["method"] == FULL) for f in families}
    table = {"rows": summary}
    needle = {"rows": [r for r in summary if r["task"] == "needle"]}
    text = ["## Normalised score (full cache = 100), families pooled ("
            + ", ".join(f"{f}: n={n[f]}" for f in families) + "; all = mean over the families)", "",
            pivot_table(table, "normalized", 1), "",
            "## KL(full || method), nats per answer token", "", pivot_table(table, "kl", 3), "",
            "## Fraction of needle tokens kept (needle family)", "", pivot_table(needle, "needle_kept", 2)]  # fmt: skip
    print("\n".join(text))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paper_table.md").write_text("\n".join(text) + "\n")
        (args.out / "paper_table.jsonl").write_text("".join(json.dumps(r) + "\n" for r in summary))
        from kvforge.eval.runner import read_run_info

        info = read_run_info(args.run)["settings"]
        title = f"{info.get('model', '')} ({info.get('mode', '')}), 4k-token prompts"
        plot(summary, families, args.out / "paper_comparison.png", title)
        plot(summary, families, args.out / "paper_comparison_kl.png", title, column="kl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
