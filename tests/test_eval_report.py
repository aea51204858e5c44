import csv
import json
from pathlib import Path

import pytest

from kvforge.eval.report import family_pivots, markdown_table, plot, summarize, write_all


def _row(id_, task, method, ratio, score, ttft=1.0, kept=1.0, **extra):
    return {"id": id_, "task": task, "method": method, "compression_ratio": ratio, "score": score, "ttft_s": ttft,
            "cache_bytes": 1000 * kept, "kept_ratio": kept, "peak_memory_bytes": 5, **extra}  # fmt: skip


ROWS = [
    _row("a", "t1", "full", 0.0, 1.0, ttft=2.0, kl=0.0),
    _row("b", "t1", "full", 0.0, 0.5, ttft=4.0, kl=0.0),
    _row("a", "t1", "snapkv", 0.75, 0.5, kept=0.25, kl=1.0),
    _row("b", "t1", "snapkv", 0.75, 0.25, kept=0.25, kl=3.0),
    _row("c", "t2", "full", 0.0, 0.0),
    _row("c", "t2", "snapkv", 0.75, 1.0, kept=0.25),
    _row("d", "t2", "full", 0.0, 1.0),
    _row("d", "t2", "snapkv", 0.75, 0.0, kept=0.25),
]


def test_summary_by_hand():
    s = summarize(ROWS, "m", "query-aware")
    assert (s["model"], s["mode"]) == ("m", "query-aware")
    by = {(r["task"], r["method"]): r for r in s["rows"]}
    t1 = by[("t1", "snapkv")]
    # mean 0.375 vs full mean 0.75 on the same two examples -> 50
    assert (t1["n"], t1["score"], t1["normalized"], t1["kl"], t1["kept_ratio"]) == (2, 37.5, 50.0, 2.0, 0.25)
    assert by[("t1", "full")]["normalized"] == 100.0 and by[("t1", "full")]["ttft_s"] == 3.0
    assert by[("t2", "snapkv")]["normalized"] == 100.0  # 0.5 / 0.5
    # "all": mean over tasks of each column
    overall = by[("all", "snapkv")]
    assert (
        overall["n"] == 4 and overall["normalized"] == pytest.approx(75.0) and overall["score"] == pytest.approx(43.75)
    )
    assert [r["task"] for r in s["rows"]][-2:] == ["all", "all"] and s["rows"][0]["method"] == "full"


def test_normalized_only_on_paired_examples_and_none_when_full_scores_zero():
    rows = [_row("a", "t", "full", 0.0, 0.0), _row("a", "t", "x", 0.5, 1.0), _row("b", "t", "x", 0.5, 1.0)]
    by = {r["method"]: r for r in summarize(rows, "m", "q")["rows"]}
    assert by["x"]["normalized"] is None and by["x"]["score"] == 100.0
    rows = [_row("a", "t", "full", 0.0, 0.5), _row("a", "t", "x", 0.5, 0.25), _row("b", "t", "x", 0.5, 1.0)]
    by = {r["method"]: r for r in summarize(rows, "m", "q")["rows"]}
    assert by["x"]["normalized"] == 50.0  # example b has no full row: left out of the ratio


def test_files_and_table(tmp_path):
    summary = write_all(tmp_path, ROWS, "m", "query-aware", command="kvforge eval ...")
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    with (tmp_path / "summary.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(summary["rows"])
    assert list(table[0])[:9] == ["method", "compression_ratio", "kept_ratio", "task", "n", "score", "normalized",
                                  "ttft_s", "cache_bytes"]  # fmt: skip
    report = (tmp_path / "report.md").read_text()
    assert "![score_vs_cache](score_vs_cache.png)" in report and "`kvforge eval ...`" in report
    for name in ("score_vs_cache.png", "ttft.png", "kl_vs_cache.png", "by_task.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    md = markdown_table([r for r in summary["rows"] if r["task"] == "t1"])
    # score 37.5 +- 12.5 (standard error of 50, 25), TTFT 3x below the full cache's (2 s, 4 s) on the same examples
    assert "| t1 | snapkv | 25 | 25.0 | 2 | 37.5 | 12.5 | 50.0 | 1000 | 3.00 | 0.00 | 2.000 |" in md
    # the pivot: one table per task family, all tasks first (all, t1, t2 at 25% remaining)
    assert "| method | all 25% |\n|---|---|\n| full | 100.0 |\n| snapkv | 75.0 |" in report
    assert "### t1\n\n| method | t1 25% |\n|---|---|\n| full | 100.0 |\n| snapkv | 50.0 |" in report
    assert "| snapkv | 100.0 |" in report.split("### t2")[1]


def test_rag_rows_carry_the_recompute_ratio_and_speedup():
    info = {"strategy": "cacheclip", "recompute_ratio": 0.2}
    rows = [
        _row("a", "t", "full", 0.0, 1.0, ttft=4.0),
        _row("a", "t", "cacheclip", 0.2, 1.0, ttft=1.0, info=info),
        _row("a", "t", "naive", 0.0, 0.0, ttft=0.5, info={"strategy": "naive", "recompute_ratio": 0.0}),
    ]
    s = summarize(rows, "m", "rag")
    by = {r["method"]: r for r in s["rows"]}
    assert by["cacheclip"]["recompute_ratio"] == 0.2 and by["cacheclip"]["ttft_speedup"] == 4.0
    assert by["naive"]["recompute_ratio"] == 0.0 and by["naive"]["normalized"] == 0.0
    assert "recompute_ratio" not in by["full"] and by["full"]["ttft_speedup"] == 1.0
    assert "| recompute % |" in markdown_table(s["rows"])


def test_standard_errors_of_every_plotted_quantity():
    s = summarize(ROWS, "m", "query-aware")
    by = {(r["task"], r["method"]): r for r in s["rows"]}
    t1, t2, overall = by[("t1", "snapkv")], by[("t2", "snapkv")], by[("all", "snapkv")]
    assert t1["normalized_stderr"] == pytest.approx(12.5 / 75 * 100)  # score se 12.5 in units of the full mean 75
    assert t1["kl_stderr"] == pytest.approx(1.0) and by[("t1", "full")]["ttft_stderr"] == pytest.approx(1.0)
    assert t2["normalized_stderr"] == pytest.approx(50 / 50 * 100)
    # the mean of two independent task means: sqrt(se1^2 + se2^2) / 2
    expected = (t1["normalized_stderr"] ** 2 + t2["normalized_stderr"] ** 2) ** 0.5 / 2
    assert overall["normalized_stderr"] == pytest.approx(expected)
    assert overall["kl_stderr"] == pytest.approx(1.0)  # only t1 has KL values: the mean is over t1 alone


def _saved_figures(monkeypatch):
    """file name -> the y labels and x labels of every panel of the figure saved there."""
    import matplotlib.figure

    saved = {}

    def savefig(fig, path, *a, **k):
        saved[Path(path).name] = [(ax.get_ylabel(), ax.get_xlabel()) for ax in fig.axes if ax.axison]

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return saved


def test_no_figure_mixes_kl_and_score_panels(tmp_path, monkeypatch):
    saved = _saved_figures(monkeypatch)
    rows = [dict(r, kl=r.get("kl", 0.5)) for r in ROWS] + [
        _row("e", "t3", "full", 0.0, 0.0),
        _row("e", "t3", "snapkv", 0.75, 0.0),
    ]
    plot(tmp_path, summarize(rows, "m", "query-aware"))
    assert {"score_vs_cache.png", "kl_vs_cache.png", "ttft.png", "by_task.png", "by_task_kl.png"} <= set(saved)
    for name, labels in saved.items():
        kinds = {"kl" if "KL" in y else "score" if "score" in y else "time" for y, _ in labels}
        assert len(kinds) == 1, (name, labels)
    assert [y for y, _ in saved["by_task.png"]] == ["score (full = 100)"] * 2 + ["score (full scored 0)"]
    assert {y for y, _ in saved["by_task_kl.png"]} == {"KL(full || method)"}


def test_ttft_plot_shows_the_stages_and_the_overhead_on_its_own_scale(tmp_path, monkeypatch):
    stages = {"full": (2.0, 0.0, 0.0), "snapkv": (2.0, 0.02, 0.0), "snapkv-lookahead": (2.0, 0.02, 0.3)}
    rows = []
    for i in range(2):
        for method, (prefill, comp, look) in stages.items():
            ttft = prefill + comp + look + 0.1 * i
            stage = {"prefill": prefill + 0.1 * i, "compression": comp, "lookahead": look}
            rows.append(_row(f"e{i}", "t", method, 0.0 if method == "full" else 0.5, 1.0, ttft=ttft, ttft_stages=stage))
    s = summarize(rows, "m", "q")
    by = {r["method"]: r for r in s["rows"]}
    assert by["snapkv-lookahead"]["ttft_lookahead_s"] == pytest.approx(0.3)
    assert by["snapkv"]["ttft_compression_s"] == pytest.approx(0.02) and by["full"]["ttft_compression_s"] == 0.0
    assert by["snapkv"]["ttft_prefill_s"] == pytest.approx(2.05)
    saved = _saved_figures(monkeypatch)
    plot(tmp_path, s)
    assert [x for _, x in saved["ttft.png"]] == [
        "TTFT (s), mean over examples",
        "compression + lookahead (ms; % of TTFT)",
    ]


def test_family_pivots_fit_a_page():
    rows = [_row(f"{t}{i}", t, m, r, 1.0 if m == "full" or i else 0.0) for t in ("ruler-mk", "ruler-vt", "needle")
            for i in range(2) for m, r in (("full", 0.0), ("snapkv", 0.5), ("snapkv", 0.75))]  # fmt: skip
    tables = "\n".join(family_pivots(summarize(rows, "m", "q")))
    assert [line for line in tables.splitlines() if line.startswith("###")] == [
        "### all tasks (mean of 3)", "### needle", "### ruler (mean of ruler-mk, ruler-vt)"]  # fmt: skip
    assert "| method | ruler 25% | ruler 50% |" in tables and "| snapkv | 50.0 | 50.0 |" in tables
    assert max(len(line.split("|")) for line in tables.splitlines()) <= 6  # method + one column per budget
