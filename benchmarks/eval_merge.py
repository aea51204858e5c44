"""Merge several ``kvforge eval`` folders into one and summarise them with the harness's own report.

Why: one eval run per task group (and per seed) keeps each resumable and lets the mix be weighted (more needles
than RULER examples) without changing the harness; the headline table needs them together. Example ids are
prefixed with their folder's name (two seeds give the same ids). ``--pool`` relabels every row's task as ``mix``,
so that ``normalized`` is the harness's ratio of mean scores over ALL examples of the mix (each example weighs the
same) instead of its task "all" (each task weighs the same, which lets one partly answered QA example weigh as much
as every needle together). Writes ``OUT/results.jsonl``, ``run.json``, ``summary.csv``, ``report.md`` and the
plots through :func:`kvforge.eval.report.write_all`, and prints ``normalised / mean KL`` per press and kept share.

    python benchmarks/eval_merge.py runs/qa4k runs/qa4k-needle runs/qa4k-needle-s1 runs/qa4k-mix --pool
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvforge.eval.report import FULL, write_all
from kvforge.eval.runner import load_rows, read_run_info


def merged_rows(folders: list[Path], pool: bool) -> list[dict]:
    rows = []
    for folder in folders:
        for row in load_rows(folder / "results.jsonl"):
            row = dict(row, id=f"{folder.name}:{row['id']}")
            if pool:
                row["source_task"], row["task"] = row["task"], "mix"
            rows.append(row)
    return rows


def table(summary: dict, methods: list[str] | None = None) -> str:
    """Markdown: presses x kept share, each cell ``normalised / mean KL`` of the pooled (or "all") rows."""
    rows = [r for r in summary["rows"] if r["task"] in ("mix", "all") and r["method"] != FULL]
    if not rows:  # a single task: its own rows
        rows = [r for r in summary["rows"] if r["method"] != FULL]
    ratios = sorted({r["compression_ratio"] for r in rows})
    names = methods or sorted({r["method"] for r in rows})
    cell = {(r["method"], r["compression_ratio"]): r for r in rows}
    out = ["| press | " + " | ".join(f"keep {100 * (1 - x):g}%" for x in ratios) + " |", "|---|" + "---|" * len(ratios)]
    for m in names:
        vals = []
        for x in ratios:
            r = cell.get((m, x))
            norm = "-" if r is None or r.get("normalized") is None else f"{r['normalized']:.0f}"
            kl = "-" if r is None or r.get("kl") is None else f"{r['kl']:.3f}"
            vals.append(f"{norm} / {kl}")
        out.append(f"| `{m}` | " + " | ".join(vals) + " |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--pool", action="store_true", help="one task 'mix': every example weighs the same")
    p.add_argument("--methods", default=None, help="row order of the printed table (comma-separated)")
    args = p.parse_args()
    infos = [read_run_info(f) for f in args.folders]
    models = {i["settings"].get("model") for i in infos}
    modes = {i["settings"].get("mode") for i in infos}
    if len(models) != 1 or len(modes) != 1:
        raise SystemExit(f"folders of different models or modes: {sorted(map(str, models))} {sorted(map(str, modes))}")
    rows = merged_rows(args.folders, args.pool)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    commands = [r["command"] for i in infos for r in i["runs"] if r.get("command")]
    sources = " + ".join(f"{f.name}: {i['settings'].get('task')}" for f, i in zip(args.folders, infos, strict=True))
    settings = dict(infos[0]["settings"], task=sources)
    (args.out / "run.json").write_text(
        json.dumps({"settings": settings, "runs": [r for i in infos for r in i["runs"]]})
    )
    summary = write_all(args.out, rows, models.pop(), modes.pop(), commands)
    full = [r for r in rows if r["method"] == FULL]
    print(f"{len(full)} examples, the full cache answers {sum(r['score'] > 0 for r in full)} (score > 0)")
    print(table(summary, args.methods.split(",") if args.methods else None))


if __name__ == "__main__":
    main()
