"""Store once, ask many: documents stored once per (press, ratio, quant) and every question answered from the store."""

import pytest

from kvforge.engine import Engine
from kvforge.eval.data import Example
from kvforge.eval.report import summarize
from kvforge.eval.runner import EvalRunner, press_trial, press_trials
from kvforge.eval.stored import stored_trials
from kvforge.testing import tiny_model, tiny_tokenizer

DOC = "The quick brown fox jumps over the lazy dog. The code is 4242. The door is red. " * 3
EXAMPLES = [
    Example(id="d1-q0", context=DOC, question="What is the code?", answers=["4242"], task="multi", max_new_tokens=4),
    Example(id="d1-q1", context=DOC, question="What colour is the door?", answers=["red"], task="multi",
            max_new_tokens=4),
]  # fmt: skip


@pytest.mark.usefixtures("one_thread")
def test_store_once_rows_match_in_process_runs(tmp_path):
    engine = Engine(tiny_model("llama"), tiny_tokenizer(), chunk_size=None)
    trials = press_trials(["full", "knorm"], [0.5], query_aware=False)  # in-process query-agnostic references
    trials += stored_trials(["full", "knorm"], [0.5], ["none", "int4"])
    rows = EvalRunner(engine, trials, tmp_path, {"model": "tiny"}, with_fidelity=True).run(EXAMPLES, progress=False)
    by = {(r["id"], r["method"]): r for r in rows}
    for ex in EXAMPLES:
        # full-precision stored documents answer exactly as the in-process runs (bit-exact KV round trip)
        assert by[(ex.id, "stored-full+none")]["prediction"] == by[(ex.id, "full")]["prediction"]
        assert by[(ex.id, "stored-full+none")]["kl"] == 0.0
        assert by[(ex.id, "stored-knorm+none")]["prediction"] == by[(ex.id, "knorm")]["prediction"]
        assert by[(ex.id, "stored-knorm+none")]["kl"] == by[(ex.id, "knorm")]["kl"]
        assert by[(ex.id, "stored-full+int4")]["kl"] > 0  # the fidelity columns see the quantised KV
        int4, none = by[(ex.id, "stored-knorm+int4")], by[(ex.id, "stored-knorm+none")]
        assert int4["stored_bytes"] < 0.4 * none["stored_bytes"] < by[(ex.id, "stored-full+none")]["stored_bytes"]
        assert none["kept_ratio"] == by[(ex.id, "knorm")]["kept_ratio"] < 1
    # stored once: both questions report the one store operation of their document
    assert by[("d1-q0", "stored-knorm+int4")]["store_s"] == by[("d1-q1", "stored-knorm+int4")]["store_s"]
    summary = summarize(rows, "tiny", "store-once")
    stored_row = next(r for r in summary["rows"] if r["method"] == "stored-knorm+int4")
    assert stored_row["stored_bytes"] > 0 and stored_row["ttft_speedup"] is not None and stored_row["kl"] > 0


def test_stored_trials_check_names_early():
    with pytest.raises(ValueError, match="quantisation"):
        stored_trials(["knorm"], [0.5], ["int3"])
    assert [t.method for t in stored_trials(["full", "knorm"], [0.5, 0.75], ["none"])] == [
        "stored-full+none", "stored-knorm+none", "stored-knorm+none"]  # fmt: skip
    assert press_trial("full", 0.0).method == "full"


@pytest.mark.usefixtures("one_thread")
def test_a_second_run_loads_what_another_process_stored_with_kvtc(tmp_path, monkeypatch):
    """--store file:///dir: the first run compresses, codes (kvtc, kvzip's head-wise layers unpadded) and stores each
    document; a second run (a fresh process: another basis book, another cache dir) finds them in the store and
    answers identically from them; rows carry the frontier's columns (bytes as a fraction of fp16, load time)."""
    import subprocess
    import sys

    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "cache1"))
    store = f"file://{tmp_path}/store"
    engine = Engine(tiny_model("llama"), tiny_tokenizer(), chunk_size=None)
    trials = [press_trial("full", 0.0, query_aware=False), *stored_trials(["kvzip"], [0.5], ["none", "kvtc"], store)]
    first = EvalRunner(engine, trials, tmp_path / "a", {"model": "tiny"}, with_fidelity=True).run(EXAMPLES,
                                                                                                   progress=False)
    by = {(r["id"], r["method"]): r for r in first}
    for ex in EXAMPLES:
        kvtc, none = by[(ex.id, "stored-kvzip+kvtc")], by[(ex.id, "stored-kvzip+none")]
        assert kvtc["stored_bytes"] < 0.5 * none["stored_bytes"] and 0 < kvtc["stored_fraction"] < 0.5
        assert none["fp16_bytes"] == kvtc["fp16_bytes"] and kvtc["load_s"] > 0
    assert by[("d1-q0", "stored-kvzip+kvtc")]["stored_by_run"] and by[("d1-q1", "stored-kvzip+kvtc")]["store_s"] > 0
    code = f"""
import json, sys
import torch
torch.set_num_threads(1)  # as this process (one_thread): the model's own arithmetic is the same
from kvforge.engine import Engine
from kvforge.eval.runner import EvalRunner, press_trial
from kvforge.eval.stored import stored_trials
from kvforge.testing import tiny_model, tiny_tokenizer
sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
from test_eval_stored import EXAMPLES
engine = Engine(tiny_model("llama"), tiny_tokenizer(), chunk_size=None)
trials = [press_trial("full", 0.0, query_aware=False), *stored_trials(["kvzip"], [0.5], ["none", "kvtc"], {store!r})]
rows = EvalRunner(engine, trials, __import__("pathlib").Path({str(tmp_path / "b")!r}), {{"model": "tiny"}},
                  with_fidelity=True).run(EXAMPLES, progress=False)
print(json.dumps([[r["id"], r["method"], r["prediction"], r.get("kl"), r.get("stored_by_run")] for r in rows]))
"""
    env = {**__import__("os").environ, "KVFORGE_CACHE_DIR": str(tmp_path / "cache2")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    second = {(i, m): (p, kl, s) for i, m, p, kl, s in __import__("json").loads(out.stdout.strip().splitlines()[-1])}
    for (i, m), (pred, kl, stored_by_run) in second.items():
        if m.startswith("stored-"):
            assert stored_by_run is False  # loaded from the store the first run wrote
            assert pred == by[(i, m)]["prediction"] and kl == by[(i, m)]["kl"]  # bit-exact decode in another process
