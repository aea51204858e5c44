"""Summaries of ``results.jsonl``: ``summary.json``, ``summary.csv``, PNG plots and ``report.md``.

Per (task, method, ratio): ``n`` examples, ``score`` = 100 x mean metric (``score_stderr`` its standard error),
``normalized`` = 100 x mean score / mean score of the full cache on the same examples (SurrogateKV's measure), mean
TTFT and ``ttft_speedup`` = full-cache TTFT / this TTFT on the same examples, cache bytes, kept ratio, for RAG rows
the ``recompute_ratio`` and, when present, the fidelity columns. Task ``"all"`` averages the per-task values (each
task weighs the same).
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvforge.eval.metrics import normalized_score

FULL = "full"
FIDELITY = ("answer_nll", "kl", "top1_agreement", "needle_kept")
TTFT_STAGES = ("prefill", "compression", "lookahead")  # the parts of a TTFT (kvforge.eval.runner.ttft_stages)
STORED = ("stored_bytes", "store_s", "fp16_bytes", "stored_fraction", "load_s")  # "store once, ask many" rows
COLUMNS = ["method", "compression_ratio", "kept_ratio", "task", "n", "score", "normalized", "ttft_s", "cache_bytes"]


def _mean(values: list[Any]) -> float | None:
    nums = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(nums) / len(nums) if nums else None


def _stderr(values: list[float]) -> float | None:
    """Standard error of the mean (sample standard deviation / sqrt(n)); None below two values."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def _scaled(stderr: float | None, full: float | None) -> float | None:
    """The standard error of a score, in units of the full cache's score (x 100)."""
    return None if stderr is None or not full else stderr / (100.0 * full) * 100.0


def summarize(rows: list[dict[str, Any]], model: str, mode: str) -> dict[str, Any]:
    """The ``summary.json`` object: ``{"model", "mode", "rows": [...]}`` (full first, then by method and ratio)."""
    full_score = {r["id"]: r["score"] for r in rows if r["method"] == FULL}
    full_ttft = {r["id"]: r["ttft_s"] for r in rows if r["method"] == FULL}
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["method"], float(r["compression_ratio"]))].append(r)
    out: list[dict[str, Any]] = []
    for (task, method, ratio), group in groups.items():
        paired = [r for r in group if r["id"] in full_score]
        score = _mean([r["score"] for r in group])
        full = _mean([full_score[r["id"]] for r in paired])
        ttft, ref_ttft = _mean([r["ttft_s"] for r in paired]), _mean([full_ttft[r["id"]] for r in paired])
        paired_scores = [100.0 * r["score"] for r in paired if r["score"] is not None]
        row = {
            "method": method,
            "compression_ratio": ratio,
            "kept_ratio": _mean([r.get("kept_ratio") for r in group]),
            "task": task,
            "n": len(group),
            "score": None if score is None else 100.0 * score,
            "score_stderr": _stderr([100.0 * r["score"] for r in group if r["score"] is not None]),
            "normalized": None if full is None else normalized_score(_mean([r["score"] for r in paired]) or 0.0, full),
            # the full cache's mean is taken as exact: the spread is that of this method's scores on the same examples
            "normalized_stderr": _scaled(_stderr(paired_scores), full),
            "ttft_s": _mean([r["ttft_s"] for r in group]),
            "ttft_stderr": _stderr([r["ttft_s"] for r in group if r["ttft_s"] is not None]),
            "ttft_speedup": ref_ttft / ttft if ttft and ref_ttft else None,
            "cache_bytes": _mean([r["cache_bytes"] for r in group]),
            "peak_memory_bytes": max((r.get("peak_memory_bytes") or 0) for r in group),
        }
        if any(isinstance(r.get("ttft_stages"), dict) for r in group):
            for stage in TTFT_STAGES:
                row[f"ttft_{stage}_s"] = _mean([(r.get("ttft_stages") or {}).get(stage) for r in group])
        strategies = [r["info"] for r in group if isinstance(r.get("info"), dict) and "strategy" in r["info"]]
        if strategies:  # a RAG row: the ratio slot holds the recompute ratio
            share = _mean([i.get("recompute_ratio") for i in strategies])
            row["recompute_ratio"] = None if share is None else round(share, 6)
        for name in FIDELITY:
            if any(name in r for r in group):
                row[name] = _mean([r.get(name) for r in group])
                row[f"{name}_stderr"] = _stderr([float(r[name]) for r in group if r.get(name) is not None])
        for name in STORED:  # stored-document rows: bytes in the store, one-off compress-and-store time
            if any(name in r for r in group):
                row[name] = _mean([r.get(name) for r in group])
        out.append(row)
    out += _overall(out)
    out.sort(key=lambda r: (r["task"] == "all", r["task"], r["method"] != FULL, r["method"], r["compression_ratio"]))
    return {"model": model, "mode": mode, "rows": out}


def _overall(task_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Task "all": per (method, ratio) the mean over tasks of every column (``n`` summed; standard errors propagated
    as those of a mean of independent task means, not pooled over examples of different kinds)."""
    if len({r["task"] for r in task_rows}) < 2:
        return []
    return _mean_over_tasks(task_rows, "all")


def _mean_over_tasks(task_rows: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    """Per (method, ratio) the mean over the tasks of ``task_rows`` of every column, as task ``label``."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in task_rows:
        groups[(r["method"], r["compression_ratio"])].append(r)
    out = []
    for (method, ratio), group in groups.items():
        row: dict[str, Any] = {"method": method, "compression_ratio": ratio, "task": label}
        row["n"] = sum(r["n"] for r in group)
        for key in group[0]:
            if key in row:
                continue
            if key.endswith("_stderr"):  # the mean of independent task means: sqrt(sum se^2) / tasks
                base = "ttft_s" if key == "ttft_stderr" else key.removesuffix("_stderr")
                errors = [r.get(key) for r in group if r.get(base) is not None]  # the tasks the mean is over
                ok = errors and None not in errors
                row[key] = math.sqrt(sum(e * e for e in errors)) / len(errors) if ok else None  # type: ignore[operator]
            else:
                row[key] = _mean([r.get(key) for r in group])
        out.append(row)
    return out


def write_summary(out_dir: Path, summary: dict[str, Any]) -> list[Path]:
    """Write ``summary.json`` and ``summary.csv``; returns their paths."""
    json_path, csv_path = out_dir / "summary.json", out_dir / "summary.csv"
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    optional = ("score_stderr", "ttft_speedup", "recompute_ratio", *FIDELITY, *STORED, "peak_memory_bytes")
    extra = [k for k in optional if any(k in r for r in summary["rows"])]
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, *extra], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summary["rows"])
    return [json_path, csv_path]


def _headline_rows(summary: dict[str, Any], task: str | None = None) -> list[dict[str, Any]]:
    tasks = {r["task"] for r in summary["rows"]}
    task = task or ("all" if "all" in tasks else sorted(tasks)[0])
    return [r for r in summary["rows"] if r["task"] == task]


def plot(out_dir: Path, summary: dict[str, Any], task: str | None = None) -> list[Path]:
    """The figures of a summary, for ``task`` (default: "all", or the only task); each figure shows one quantity:

    - ``score_vs_cache.png``: normalised score (full cache = 100) vs remaining cache per method, with standard-error
      bars;
    - ``kl_vs_cache.png`` (with fidelity columns): KL(full || method) vs remaining cache, with standard-error bars;
    - ``ttft.png``: TTFT per method and budget split into prefill / compression / lookahead, and beside it the
      overhead alone (compression + lookahead) on its own scale, so overheads of milliseconds stay visible;
    - with several tasks ``by_task.png`` (score, one panel per task) and ``by_task_kl.png`` (KL, likewise).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _headline_rows(summary, task)
    methods = sorted({r["method"] for r in rows if r["method"] != FULL})
    title = f"{summary['model']} ({summary['mode']}, task: {rows[0]['task'] if rows else '-'})"
    paths = []
    has_norm = any(r.get("normalized") is not None for r in rows)
    curves = [("normalized", "score (full cache = 100)", "score_vs_cache.png")] if has_norm else [
        ("score", "score (not normalised: the full cache scored 0)", "score_vs_cache.png")]  # fmt: skip
    curves.append(("kl", "KL(full || method), nats/token", "kl_vs_cache.png"))
    rag = _is_rag(rows)
    xlabel = "recomputed context tokens (%)" if rag else "remaining cache (%)"

    def x_of(row: dict[str, Any]) -> float:
        return 100 * (row.get("recompute_ratio") or 0.0) if rag else 100 * (1 - row["compression_ratio"])

    for column, ylabel, name in curves:
        if column == "kl" and not any(r.get(column) is not None for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=90)
        _curves(ax, rows, methods, column, x_of)
        if column == "normalized":
            ax.axhline(100, color="black", linestyle="--", linewidth=1, label="full")
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xlim=(-2, 102))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2)
        ax.text(0.99, 0.01, "bars: ±1 standard error over examples", transform=ax.transAxes, fontsize=6,
                ha="right", va="bottom", color="0.4")  # fmt: skip
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        paths.append(out_dir / name)
    paths.append(_plot_ttft(out_dir, rows, methods, title, rag))
    for column, name in (("score", "by_task.png"), ("kl", "by_task_kl.png")):
        path = _plot_by_task(out_dir, summary, x_of, xlabel, column, name)
        if path is not None:
            paths.append(path)
    return paths + _plot_stored(out_dir, rows, title)


def _curves(ax: Any, rows: list[dict[str, Any]], methods: list[str], column: str, x_of: Any, **style: Any) -> None:
    """One line per method of ``column`` vs ``x_of(row)``, with ``<column>_stderr`` as error bars where known."""
    error = "normalized_stderr" if column == "normalized" else f"{column}_stderr"
    for i, method in enumerate(methods):
        pts = sorted((x_of(r), r[column], r.get(error) or 0.0) for r in rows
                     if r["method"] == method and r.get(column) is not None)  # fmt: skip
        if not pts:
            continue
        xs, ys, es = zip(*pts, strict=True)
        ax.errorbar(xs, ys, yerr=es if any(es) else None, marker="osD^v<>ph*"[i % 10],
                    linestyle="-" if i < 10 else "--", label=method, color=_color(i), capsize=2, elinewidth=0.8,
                    **style)  # fmt: skip


def _plot_ttft(out_dir: Path, rows: list[dict[str, Any]], methods: list[str], title: str, rag: bool) -> Path:
    """``ttft.png``: horizontal bars per (method, budget), TTFT split into its stages, ±1 standard error on the
    total; a second panel shows the overhead (compression + lookahead) on its own scale, in ms."""
    import matplotlib.pyplot as plt

    ratios = sorted({r["compression_ratio"] for r in rows if r["method"] != FULL})
    bars = [r for r in rows if r["method"] == FULL and r.get("ttft_s") is not None]
    for ratio in ratios:
        bars += [r for m in methods for r in rows
                 if r["method"] == m and r["compression_ratio"] == ratio and r.get("ttft_s") is not None]  # fmt: skip
    staged = any("ttft_prefill_s" in r for r in bars)

    def label(r: dict[str, Any]) -> str:
        if r["method"] == FULL:
            return FULL
        share = f"r={r['compression_ratio']:g}" if rag else f"{100 * (1 - r['compression_ratio']):g}% kept"
        return f"{r['method']} ({share})"

    height = max(3.0, 0.24 * len(bars) + 1.4)
    fig, axes = plt.subplots(1, 2 if staged else 1, figsize=(11 if staged else 7, height), dpi=90, squeeze=False,
                             sharey=True, gridspec_kw={"width_ratios": [3, 2]} if staged else None)  # fmt: skip
    ax = axes[0][0]
    ys = list(range(len(bars)))[::-1]
    colors = {"prefill": "0.65", "compression": "tab:orange", "lookahead": "tab:red"}
    if staged:
        left = [0.0] * len(bars)
        for stage in TTFT_STAGES:
            widths = [r.get(f"ttft_{stage}_s") or 0.0 for r in bars]
            ax.barh(ys, widths, left=left, color=colors[stage], label=stage, height=0.7)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        over = axes[0][1]
        left = [0.0] * len(bars)
        for stage in TTFT_STAGES[1:]:
            widths = [1000 * (r.get(f"ttft_{stage}_s") or 0.0) for r in bars]
            over.barh(ys, widths, left=left, color=colors[stage], label=stage, height=0.7)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        for y, r, total in zip(ys, bars, left, strict=True):
            if r["ttft_s"] and total:
                over.text(total, y, f" {100 * total / 1000 / r['ttft_s']:.1f}%", va="center", fontsize=6)
        over.set(xlabel="compression + lookahead (ms; % of TTFT)")
        over.margins(x=0.15)
        over.grid(axis="x", alpha=0.3)
    else:
        ax.barh(ys, [r["ttft_s"] for r in bars], color=colors["prefill"], label="TTFT (no stage clocks)", height=0.7)
    errors = [r.get("ttft_stderr") or 0.0 for r in bars]
    if any(errors):
        ax.errorbar([r["ttft_s"] for r in bars], ys, xerr=errors, fmt="none", ecolor="black", capsize=2,
                    elinewidth=0.8, label="±1 standard error")  # fmt: skip
    ax.set_yticks(ys, [label(r) for r in bars], fontsize=7)
    ax.set(xlabel="TTFT (s), mean over examples")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=4, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out_dir / "ttft.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _stored_parts(row: dict[str, Any]) -> tuple[str, str]:
    """``stored-kvzip+kvtc-b2`` -> ``("kvzip", "kvtc-b2")``."""
    press, _, codec = row["method"].removeprefix("stored-").rpartition("+")
    return press, codec


def frontier_points(rows: list[dict[str, Any]], column: str = "normalized") -> list[dict[str, Any]]:
    """Stored rows with a byte fraction and ``column``, by increasing bytes; ``pareto`` marks the points no cheaper
    point beats (higher score, or lower KL)."""
    pts = sorted((r for r in rows if r.get("stored_fraction") and r.get(column) is not None),
                 key=lambda r: (r["stored_fraction"], -r[column] if column != "kl" else r[column]))  # fmt: skip
    best: float | None = None
    out = []
    for r in pts:
        value = r[column] if column != "kl" else -r[column]
        out.append(r | {"pareto": best is None or value > best})
        best = value if best is None else max(best, value)
    return out


def _plot_stored(out_dir: Path, rows: list[dict[str, Any]], title: str) -> list[Path]:
    """``frontier.png`` (normalised score) and ``frontier_kl.png`` (KL) against the bytes stored per document as a
    fraction of its full fp16 cache (log x): one colour per press, one marker per codec, the Pareto front drawn."""
    import matplotlib.pyplot as plt

    paths = []
    for column, ylabel, name in (("normalized", "score (full cache = 100)", "frontier.png"),
                                 ("kl", "KL(full || stored), nats/token (lower is better)", "frontier_kl.png")):
        pts = frontier_points(rows, column)
        if not pts:
            continue
        codecs = sorted({_stored_parts(r)[1] for r in pts})
        presses = sorted({_stored_parts(r)[0] for r in pts})
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=80)
        for r in pts:
            press, codec = _stored_parts(r)
            ax.scatter([100 * r["stored_fraction"]], [r[column]], color=_color(presses.index(press)),
                       marker="osD^v<>ph*"[codecs.index(codec) % 10], s=28, alpha=0.9)  # fmt: skip
        front = [r for r in pts if r["pareto"]]
        ax.step([100 * r["stored_fraction"] for r in front], [r[column] for r in front], where="post", color="black",
                linewidth=0.8, alpha=0.6, label="Pareto front")  # fmt: skip
        for i, press in enumerate(presses):
            ax.scatter([], [], color=_color(i), marker="o", label=press)
        for j, codec in enumerate(codecs):
            ax.scatter([], [], color="gray", marker="osD^v<>ph*"[j % 10], label=codec)
        if column == "normalized":
            ax.axhline(100, color="black", linestyle="--", linewidth=1)
        ax.axvline(5, color="red", linestyle=":", linewidth=1)
        ax.set(xscale="log", xlabel="bytes stored per document (% of its full fp16 cache, log)", ylabel=ylabel,
               title=title)  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=3)
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def frontier_table(rows: list[dict[str, Any]]) -> str:
    """Stored rows by bytes stored: press, ratio, codec, % of fp16, score, KL, load and TTFT; * = on the Pareto front
    of score against bytes."""
    pts = frontier_points(rows)
    if not pts:
        return ""
    head = ["press", "kept", "codec", "% of fp16", "normalized", "KL", "load ms", "TTFT ms", "speedup", "front"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in pts:
        press, codec = _stored_parts(r)
        kept = "100%" if press == FULL else f"{round(100 * (1 - r['compression_ratio']))}%"
        cells = [press, kept, codec, _fmt(100 * r["stored_fraction"], 2), _fmt(r.get("normalized")),
                 _fmt(r.get("kl"), 3), _fmt(None if r.get("load_s") is None else 1000 * r["load_s"]),
                 _fmt(None if r.get("ttft_s") is None else 1000 * r["ttft_s"]), _fmt(r.get("ttft_speedup"), 2),
                 "*" if r["pareto"] else ""]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _color(i: int) -> Any:
    """Distinct colours for up to 20 methods (tab10's dark shades first, then its light ones)."""
    import matplotlib

    return matplotlib.colormaps["tab20"]((2 * i) % 20 + (i // 10) % 2)


def _plot_by_task(
    out_dir: Path, summary: dict[str, Any], x_of: Any, xlabel: str, quantity: str, name: str
) -> Path | None:
    """One panel per task of one quantity, shared legend: ``score`` (normalised; the raw score where the full cache
    scored 0) or ``kl``. None with fewer than two tasks, or no values."""
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in summary["rows"]} - {"all"})
    if quantity == "kl":
        tasks = [t for t in tasks if any(r.get("kl") is not None for r in summary["rows"] if r["task"] == t)]
    if len(tasks) < 2:
        return None
    methods = sorted({r["method"] for r in summary["rows"] if r["method"] != FULL})
    cols = min(3, len(tasks))
    nrows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows + 0.8), dpi=80, squeeze=False)
    for ax, task in zip(axes.flat, tasks, strict=False):
        rows = [r for r in summary["rows"] if r["task"] == task]
        if quantity == "kl":
            column, ylabel = "kl", "KL(full || method)"
        elif any(r.get("normalized") is not None for r in rows if r["method"] != FULL):
            column, ylabel = "normalized", "score (full = 100)"
        else:
            column, ylabel = "score", "score (full scored 0)"
        _curves(ax, rows, methods, column, x_of, markersize=4)
        n = max((r["n"] for r in rows), default=0)
        ax.set_title(f"{task} (n={n})", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(7, len(labels)), fontsize=7)
    what = "KL(full || method)" if quantity == "kl" else "score"
    fig.suptitle(f"{summary['model']} ({summary['mode']}): {what} per task, ±1 standard error", fontsize=10)
    fig.tight_layout(rect=(0, 0.08 if handles else 0, 1, 1))
    path = out_dir / name
    fig.savefig(path)
    plt.close(fig)
    return path


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _is_rag(rows: list[dict[str, Any]]) -> bool:
    return any("recompute_ratio" in r for r in rows)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of summary rows (remaining cache or recompute ratio in %, scores, TTFT in ms, cache in MiB)."""
    fid = [k for k in FIDELITY if any(k in r for r in rows)]
    rag = _is_rag(rows)
    stored = any(r.get("stored_bytes") is not None for r in rows)
    head = ["task", "method", "recompute %" if rag else "remaining %", "kept %", "n", "score", "± se", "normalized",
            "TTFT ms", "speedup", "cache MiB", *(["stored MiB"] if stored else []), *fid]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        share = r.get("recompute_ratio") if rag else 1 - r["compression_ratio"]
        cells = [r["task"], r["method"], _fmt(None if share is None else 100 * share, 0),
                 _fmt(None if r.get("kept_ratio") is None else 100 * r["kept_ratio"]), str(r["n"]),
                 _fmt(r["score"]), _fmt(r.get("score_stderr")), _fmt(r["normalized"]),
                 _fmt(None if r["ttft_s"] is None else 1000 * r["ttft_s"], 0), _fmt(r.get("ttft_speedup"), 2),
                 _fmt(None if r["cache_bytes"] is None else r["cache_bytes"] / 2**20, 2),
                 *([_fmt(None if r.get("stored_bytes") is None else r["stored_bytes"] / 2**20, 2)] if stored else []),
                 *[_fmt(r.get(k), 3) for k in fid]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pivot_table(summary: dict[str, Any], column: str = "normalized", digits: int = 1) -> str:
    """Methods x (task, remaining cache) of one column, e.g. the normalised score: the table papers print.

    Columns are grouped by task ("all" first); the full cache is one row at 100% remaining. RAG runs put the
    recompute ratio in the columns instead.
    """
    rows = [r for r in summary["rows"] if r.get(column) is not None]
    tasks = sorted({r["task"] for r in rows}, key=lambda t: (t != "all", t))
    rag = _is_rag(rows)
    ratios = sorted({r["compression_ratio"] for r in rows if r["method"] != FULL}, reverse=not rag)
    methods = sorted({r["method"] for r in rows}, key=lambda m: (m != FULL, m))
    label = (lambda x: f"r={x:g}") if rag else (lambda x: f"{100 * (1 - x):g}%")
    head = ["method", *[f"{t} {label(x)}" for t in tasks for x in ratios]]
    cell = {(r["task"], r["method"], r["compression_ratio"]): r[column] for r in rows}
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        values = [cell.get((t, m, 0.0 if m == FULL else x)) for t in tasks for x in ratios]
        lines.append("| " + " | ".join([m, *[_fmt(v, digits) for v in values]]) + " |")
    return "\n".join(lines)


def task_family(task: str) -> str:
    """``ruler-mk`` -> ``ruler``, ``longbench-qa`` -> ``longbench``, ``needle-docs`` -> ``needle``."""
    return task.split("-", 1)[0]


def family_pivots(summary: dict[str, Any], column: str = "normalized", digits: int = 1) -> list[str]:
    """The main pivot cut to fit a page: one Markdown table per task family (all tasks first), methods x remaining
    cache, each cell the mean over the family's tasks (each task weighs the same); per-task values follow in the
    per-task tables of the report."""
    rows = [r for r in summary["rows"] if r.get(column) is not None]
    tasks = sorted({r["task"] for r in rows} - {"all"})
    families: dict[str, list[str]] = defaultdict(list)
    for task in tasks:
        families[task_family(task)].append(task)
    parts = []
    if any(r["task"] == "all" for r in rows):
        parts += [f"### all tasks (mean of {len(tasks)})", "", pivot_table({"rows": [r for r in rows
                  if r["task"] == "all"]}, column, digits), ""]  # fmt: skip
    for family, members in sorted(families.items()):
        member_rows = [r for r in rows if r["task"] in members]
        if len(members) > 1:
            member_rows = _mean_over_tasks(member_rows, family)
        heading = members[0] if len(members) == 1 else f"{family} (mean of {', '.join(members)})"
        parts += [f"### {heading}", "", pivot_table({"rows": member_rows}, column, digits), ""]
    return parts


def write_report(
    out_dir: Path, summary: dict[str, Any], plots: list[Path], command: str | list[str] | None = None
) -> Path:
    """``report.md``: settings, the plots and the summary tables (overall first, then per task). ``command``: the
    command line(s) that made the rows (a run and its resumes, from ``run.json``)."""
    parts = [f"# kvforge eval: {summary['model']}", "", f"- mode: {summary['mode']}"]
    commands = [command] if isinstance(command, str) else list(command or [])
    for i, line in enumerate(commands):
        parts.append(f"- {'command' if i == 0 else 'resumed with'}: `{line}`")
    parts += ["- score: 100 x mean metric; normalized: 100 x score / full-cache score on the same examples", ""]
    parts += [f"![{p.stem}]({p.name})" for p in plots] + [""]
    frontier = frontier_table(_headline_rows(summary))
    if frontier:
        parts += ["## Stored bytes frontier (% of the full fp16 cache; * = Pareto front)", "", frontier, ""]
    parts += ["## Normalised score (full cache = 100)", "", *family_pivots(summary, "normalized")]
    if any(r.get("kl") is not None for r in summary["rows"]):
        parts += ["## KL(full || method), nats per answer token", "", *family_pivots(summary, "kl", 3)]
    tasks = sorted({r["task"] for r in summary["rows"]}, key=lambda t: (t != "all", t))
    for task in tasks:
        parts += [f"## {task}", "", markdown_table([r for r in summary["rows"] if r["task"] == task]), ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(parts))
    return path


def write_all(
    out_dir: Path, rows: list[dict[str, Any]], model: str, mode: str, command: str | list[str] | None = None
) -> dict:
    """Summary files, plots and report for ``rows``; returns the summary."""
    summary = summarize(rows, model, mode)
    write_summary(out_dir, summary)
    write_report(out_dir, summary, plot(out_dir, summary), command)
    return summary
