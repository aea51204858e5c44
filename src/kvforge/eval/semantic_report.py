"""The semantic-reuse report: a Table-1-like table (F1/EM per dataset and policy), false-hit rates on labelled pairs
with confidence intervals, and TTFT by prompt length (``semantic.md``, ``semantic_pairs.json``, ``semantic_ttft.png``).
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvforge.eval.metrics import exact_match

logger = logging.getLogger(__name__)

FULL = "full"
PAIR_GROUPS = (  # (label, source, side, same): what each row of the pair table counts
    ("PAWS non-paraphrase: false hit", "paws", "evaluation", False),
    ("same-paragraph question: false hit", "squad-same-paragraph", "evaluation", False),
    ("near-miss hold-out 4 (unseen kinds): false hit", "near-miss-holdout-4", "evaluation", False),
    ("near-miss hold-out 3 (seen in the marks-edge fix): false hit", "near-miss-holdout-3", "evaluation", False),
    ("near-miss hold-out 2 (seen in the marks/case fix): false hit", "near-miss-holdout-2", "evaluation", False),
    ("near-miss hold-out 1 (seen in the insertion fix): false hit", "near-miss-holdout", "evaluation", False),
    ("near-miss written kinds (calibration): false hit", "near-miss", "calibration", False),
    ("SQuAD paraphrase: hit", "squad-paraphrase", "evaluation", True),
    ("PAWS paraphrase: hit", "paws", "evaluation", True),
    ("hold-out 4 paraphrase: hit", "near-miss-holdout-4", "evaluation", True),
    ("hold-out 3 paraphrase: hit", "near-miss-holdout-3", "evaluation", True),
    ("hold-out 2 paraphrase: hit", "near-miss-holdout-2", "evaluation", True),
    ("hold-out 1 paraphrase: hit", "near-miss-holdout", "evaluation", True),
    ("written paraphrase (calibration): hit", "near-miss", "calibration", True),
)


def pair_rates(specs: list[str], data_dir: Path | None, embedder: Any, cache: Path | None) -> dict[str, Any]:
    """Hit and false-hit rates of each policy spec on the labelled pairs (no model needed), each pair decided by
    the decision function every entry point uses (:class:`kvforge.reuse.decide.Decider`) with no statistics yet,
    as a fresh store would."""
    from kvforge.eval.semantic import check_spec
    from kvforge.eval.semantic_pairs import load_pairs, rate, score_pairs
    from kvforge.reuse.decide import build_decider

    pairs = score_pairs(load_pairs(data_dir), embedder, cache)
    out: dict[str, Any] = {"policies": {}}
    for spec in specs:
        decider = build_decider(embedder, **check_spec(spec))
        hits = decide_pairs(decider, pairs)
        groups = {}
        for label, source, side, same in PAIR_GROUPS:
            chosen = [i for i, p in enumerate(pairs) if p.source == source and p.side == side and p.same == same]
            if chosen:
                groups[label] = rate(chosen, hits.__getitem__)
        kinds = defaultdict(list)
        for i, p in enumerate(pairs):
            if p.source.startswith("near-miss-holdout") and not p.same:
                kinds[f"{p.source}:{p.kind}"].append(i)
        out["policies"][spec] = {
            "threshold": decider.policy.threshold_for("", decider.guards, None),
            "scorer": decider.scorer,
            "guards": list(decider.guards),
            "policy": decider.describe(),
            "groups": groups,
            "holdout_kinds": {k: rate(v, hits.__getitem__) for k, v in sorted(kinds.items())},
        }
    return out


def decide_pairs(decider: Any, pairs: list[Any], chunk: int = 128) -> list[bool]:
    """Whether ``decider`` serves each pair's stored prompt for its asked one (pairs carry their cosine similarity;
    the verifier scores a chunk of pairs at a time, then each pair is decided)."""
    from kvforge.reuse.policy import POPULATION_FLOOR

    hits = []
    for start in range(0, len(pairs), chunk):
        part = pairs[start : start + chunk]
        if decider.verifier is not None:  # batched: decide() then finds each score cached
            decider.verifier.score_many([(p.asked, p.stored) for p in part if p.similarity >= POPULATION_FLOOR])
        for p in part:
            decision = decider.decide(p.asked, p.stored, p.similarity)
            p.score = decision.score
            hits.append(decision.is_hit)
    return hits


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def pairs_table(rates: dict[str, Any]) -> str:
    policies = rates["policies"]
    specs = list(policies)
    lines = ["| pairs | " + " | ".join(f"{s} ({policies[s].get('scorer', 'cosine')} >= {policies[s]['threshold']:.3f})"
                                     for s in specs) + " |",
             "|---|" + "---|" * len(specs)]  # fmt: skip
    labels = [label for label, *_ in PAIR_GROUPS if any(label in policies[s]["groups"] for s in specs)]
    for label in labels:
        cells = []
        for s in specs:
            g = policies[s]["groups"].get(label)
            cells.append("-" if g is None else f"{_pct(g['rate'])} ({g['hits']}/{g['n']}; CI {_pct(g['ci95'][0])}-"
                         f"{_pct(g['ci95'][1])})")  # fmt: skip
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table1(rows: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Per task and method: F1, EM, hit rate, normalised F1 vs full, KL, TTFT and TTFT reduction (paired by id)."""
    full = {r["id"]: r for r in rows if r["method"] == FULL}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["method"])].append(r)
    out = []
    for (task, method), group in sorted(groups.items(), key=lambda kv: (_task_key(kv[0][0]), kv[0][1] != FULL,
                                                                         kv[0][1])):  # fmt: skip
        paired = [r for r in group if r["id"] in full]
        n = len(group)
        f1 = sum(r["score"] for r in group) / n
        em = sum(exact_match(r["prediction"], r["answers"]) for r in group) / n
        full_f1 = sum(full[r["id"]]["score"] for r in paired) / len(paired) if paired else None
        ttft = sum(r["ttft_s"] for r in group) / n
        full_ttft = sum(full[r["id"]]["ttft_s"] for r in paired) / len(paired) if paired else None
        kls = [r["kl"] for r in group if r.get("kl") is not None]
        out.append({
            "task": task, "method": method, "n": n, "f1": f1, "em": em,
            "hit_rate": None if method == FULL else sum(bool(r.get("hit")) for r in group) / n,
            "normalized": 100 * f1 / full_f1 if full_f1 else None,
            "kl": sum(kls) / len(kls) if kls else None,
            "ttft_s": ttft,
            "ttft_reduction": 1 - ttft / full_ttft if full_ttft else None,
            "prompt_tokens": sum(full[r["id"]]["prompt_tokens"] for r in paired) / len(paired) if paired else None,
        })  # fmt: skip
    lines = ["| dataset | policy | n | F1 | EM | hit | normalised F1 | KL | TTFT (ms) | TTFT reduction |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in out:
        lines.append(
            f"| {r['task']} | {r['method']} | {r['n']} | {r['f1']:.3f} | {r['em']:.3f} | {_pct(r['hit_rate'])} | "
            f"{_num(r['normalized'], '.1f')} | {_num(r['kl'], '.3f')} | {1000 * r['ttft_s']:.0f} | "
            f"{_pct(r['ttft_reduction'])} |"
        )
    return "\n".join(lines), out


def _task_key(task: str) -> tuple[int, str]:
    m = re.search(r"-(\d+)$", task)
    return (int(m.group(1)) if m else 0, task)


def plot_ttft_by_length(out_dir: Path, summary: list[dict[str, Any]]) -> Path | None:
    """``semantic_ttft.png``: mean TTFT against prompt length per policy (the semantic-long rows), log scale."""
    long_rows = [r for r in summary if r["task"].startswith("semantic-long-") and r["prompt_tokens"]]
    if not long_rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=90)
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in long_rows:
        by_method[r["method"]].append(r)
    for method, group in sorted(by_method.items(), key=lambda kv: kv[0] != FULL):
        group.sort(key=lambda r: r["prompt_tokens"])
        xs = [r["prompt_tokens"] for r in group]
        style = {"color": "black", "linestyle": "--"} if method == FULL else {}
        ax.plot(xs, [r["ttft_s"] for r in group], marker="o", label=method, **style)
        if method != FULL:
            ax2.plot(xs, [100 * (r["ttft_reduction"] or 0) for r in group], marker="o", label=method)
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="mean TTFT (s)", title="TTFT by prompt length")
    ax2.set(xscale="log", xlabel="prompt tokens", ylabel="TTFT reduction vs full prefill (%)",
            title="TTFT reduction (misses included)")  # fmt: skip
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "semantic_ttft.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def write_semantic_report(out_dir: Path, rows: list[dict[str, Any]], commands: list[str]) -> Path | None:
    """``semantic.md`` (and the plot) for the semantic rows of ``rows``; None when there are none."""
    semantic = [r for r in rows if str(r["method"]).startswith("semantic:")]
    if not semantic:
        return None
    ids = {r["id"] for r in semantic}
    table, summary = table1([r for r in rows if r["id"] in ids])
    (out_dir / "semantic_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    parts = ["# Semantic reuse", ""]
    parts += [f"`{c}`" for c in commands] + [""]
    parts += ["## Answers (Table-1 style: F1/EM per dataset and policy)", "", table, ""]
    rates_path = out_dir / "semantic_pairs.json"
    if rates_path.is_file():
        parts += ["## Hit and false-hit rates on labelled pairs (95% Clopper-Pearson intervals)", "",
                  pairs_table(json.loads(rates_path.read_text())), ""]  # fmt: skip
    plot = plot_ttft_by_length(out_dir, summary)
    if plot is not None:
        parts += [f"![TTFT by prompt length]({plot.name})", ""]
    path = out_dir / "semantic.md"
    path.write_text("\n".join(parts))
    return path
