"""The RAG frontier: normalised score, KL and TTFT speed-up against the recompute share, per method and set.

Reads the ``results.jsonl`` of ``kvforge eval --rag ... --fidelity`` runs (several allowed; rows keyed by example,
method and ratio). Per set (a task, and all tasks pooled): normalised score = 100 x mean score / the full cache's
mean on the same examples; KL = mean KL(full || method) of the answer tokens; speed-up = median over examples of
(full prefill TTFT / method TTFT), both measured in the same run, one after the other. Prints one JSON line per
(set, method, share) and a markdown table; ``--plot`` writes a three-panel figure.

    python benchmarks/plot_rag_frontier.py runs/rag_frontier_*/results.jsonl --plot results/rag_frontier/frontier.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvforge.eval.metrics import normalized_score

FULL = "full"


def read_rows(paths: list[str]) -> list[dict[str, Any]]:
    """Rows of every run, each tagged with its run (a reuse row is compared with the full prefill of its own run)."""
    rows: dict[tuple[int, str, str, float], dict[str, Any]] = {}
    for run, path in enumerate(paths):
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line) | {"run": run}
                rows[(run, r["id"], r["method"], round(float(r["compression_ratio"]), 6))] = r
    return list(rows.values())


def points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    full = {(r["run"], r["id"]): r for r in rows if r["method"] == FULL}
    sets: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if (r["run"], r["id"]) in full:
            sets[r["task"]].append(r)
            sets["all"].append(r)
    out = []
    for name, members in sorted(sets.items()):
        groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
        for r in members:
            groups[(r["method"], round(float(r["compression_ratio"]), 6))].append(r)
        for (method, ratio), group in sorted(groups.items()):
            refs = [full[(r["run"], r["id"])] for r in group]
            mean = statistics.fmean(r["score"] for r in group)
            full_mean = statistics.fmean(r["score"] for r in refs)
            kls = [r["kl"] for r in group if r.get("kl") is not None]
            shares = [r["info"].get("recomputed_tokens", 0) / max(1, _context(r)) for r in group]
            speed = [f["ttft_s"] / r["ttft_s"] for f, r in zip(refs, group, strict=True) if r["ttft_s"] > 0]
            out.append({
                "set": name, "method": method, "ratio": ratio, "n": len(group),
                "recompute_share": round(statistics.fmean(shares), 4) if method != FULL else 1.0,
                "score": round(mean, 4), "full_score": round(full_mean, 4),
                "normalized": None if full_mean == 0 else round(normalized_score(mean, full_mean) or 0.0, 1),
                "kl": round(statistics.fmean(kls), 4) if kls else None,
                "speedup_median": round(statistics.median(speed), 2) if speed else None,
            })
    return out


def _context(row: dict[str, Any]) -> int:
    """Context (chunk) tokens of a reuse row: reused + recomputed (the prefix is reused too, a few tokens)."""
    info = row["info"]
    return int(info.get("reused_tokens", 0)) + int(info.get("recomputed_tokens", 0))


def table(pts: list[dict[str, Any]]) -> str:
    head = "| set | method | recompute % | n | normalised | KL | TTFT speed-up (median) |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for p in pts:
        if p["method"] == FULL:
            continue
        kl = "-" if p["kl"] is None else f"{p['kl']:.3f}"
        lines.append(f"| {p['set']} | {p['method']} | {100 * p['recompute_share']:.1f} | {p['n']} | "
                     f"{p['normalized']} | {kl} | {p['speedup_median']}× |")
    return "\n".join(lines)


def plot(pts: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted({p["set"] for p in pts})
    colour = {m: f"C{i}" for i, m in enumerate(sorted({p["method"] for p in pts}))}  # one colour per method
    fig, axes = plt.subplots(len(sets), 3, figsize=(14, 3.6 * len(sets)), squeeze=False)
    for row, name in zip(axes, sets, strict=True):
        by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for p in pts:
            if p["set"] == name and p["method"] != FULL:
                by_method[p["method"]].append(p)
        for method, ps in sorted(by_method.items()):
            ps.sort(key=lambda p: p["recompute_share"])
            x = [100 * p["recompute_share"] for p in ps]
            style = "o-" if len(ps) > 1 else "s"
            for ax, key in zip(row, ("normalized", "kl", "speedup_median"), strict=True):
                ax.plot(x, [p[key] for p in ps], style, label=method, color=colour[method])
        for ax, label in zip(row, ("normalised score (full = 100)", "KL(full || reuse)", "TTFT speed-up (×)"),
                             strict=True):  # fmt: skip
            ax.set_xlabel("recompute share of context tokens (%)")
            ax.set_ylabel(label)
            ax.set_title(name)
            ax.grid(alpha=0.3)
        row[2].set_yscale("log")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results.jsonl of kvforge eval --rag runs")
    ap.add_argument("--plot", help="write the figure here (PNG)")
    args = ap.parse_args()
    pts = points(read_rows(args.results))
    for p in pts:
        print(json.dumps(p))
    print(table(pts))
    if args.plot:
        plot(pts, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
