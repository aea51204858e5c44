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
