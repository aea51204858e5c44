"""kvforge.names: the static name lists the CLI checks before importing torch stay equal to the registries."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvforge import names
from kvforge.errors import UserError


def test_name_lists_equal_the_registries():
    from kvforge.eval.tasks import TASKS
    from kvforge.eval.tasks.longbench import PROMPTS
    from kvforge.model import BUILTIN_MODELS
    from kvforge.presses import _SPECS, DESCRIPTIONS
    from kvforge.reuse import REUSE
    from kvforge.reuse.rag import STRATEGIES

    assert list(names.PRESS_NAMES) == list(_SPECS) and DESCRIPTIONS is names.PRESS_DESCRIPTIONS
    assert list(names.TASK_NAMES) == list(TASKS)
    assert set(names.LONGBENCH_SUBSETS) == set(PROMPTS)
    assert list(names.MODEL_NAMES) == list(BUILTIN_MODELS)
    assert list(names.RAG_STRATEGY_NAMES) == list(STRATEGIES)
    assert list(names.REUSE_NAMES) == list(REUSE)


@pytest.mark.parametrize(
    ("check", "name", "message"),
    [
        (names.check_press, "snapk", "unknown press 'snapk'; did you mean 'snapkv'?"),
        (names.check_task, "nedle", "unknown task 'nedle'; did you mean 'needle'"),
        (names.check_task, "hub:squad2", "did you mean 'hub:squad_v2'"),
        (names.check_rag_strategy, "cacheclp", "did you mean 'cacheclip'"),
        (names.check_reuse, "prefx", "did you mean 'prefix'"),
        (names.check_dtype, "bfloat61", "did you mean 'bfloat16'"),
        (names.check_model, "smollm2-135", "did you mean 'smollm2-135m'"),
        (names.check_model, "/no/such.gguf", "model file not found"),
        (names.check_model, "./nowhere", "not a model folder or .gguf file"),
    ],
)
def test_unknown_names_suggest_the_closest(check, name, message):
    with pytest.raises(UserError) as exc:
        check(name)
    assert message in str(exc.value)


def test_known_names_pass(tmp_path):
    assert names.check_press("snapkv") == "snapkv"
    assert names.check_task("hub:longbench/hotpotqa") == "hub:longbench/hotpotqa"
    assert names.check_model("smollm2-135m") == "builtin"
    assert names.check_model(str(tmp_path)) == "folder"
    assert names.check_model("org/model") == "hub"


def test_press_options_are_read_from_the_name():
    assert names.parse_press("kvzip") == ("kvzip", {})
    assert names.parse_press(" kvzip:pool=3 : budget=layer ") == ("kvzip", {"pool": 3, "budget": "layer"})
    assert names.parse_press("snapkv:kernel_size=7:lookahead=0") == ("snapkv", {"kernel_size": 7, "lookahead": 0})
    assert names.parse_press("adakv:alpha_safeguard=0.25")[1] == {"alpha_safeguard": 0.25}
    assert names.parse_press("kvzip-plus:keep_header=False:prompt=none")[1] == {"keep_header": False, "prompt": None}
    assert names.check_press("kvzip:pool=3") == "kvzip:pool=3"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("kvzp:pool=3", "unknown press 'kvzp'; did you mean"),
        ("kvzip:pool", "write name:key=value"),
        ("kvzip:=3", "write name:key=value"),
        ("kvzip:pool=", "write name:key=value"),
        ("kvzip:", "write name:key=value"),
        ("kvzip:pool=3:pool=5", "given twice"),
    ],
)
def test_bad_press_options_are_named(spec, message):
    with pytest.raises(UserError, match=message):
        names.parse_press(spec)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--press", "snapk", "--prompt", "hi"],
        ["generate", "--press", "snapk:window_size=8", "--prompt", "hi"],
        ["eval", "--model", "smollm2-135m", "--task", "needle", "--methods", "kvzip:pool", "--out", "/nonexistent"],
        ["generate", "--model", "smollm2-136m", "--prompt", "hi"],
        ["generate", "--dtype", "bf61", "--prompt", "hi"],
        ["serve", "--press", "snapk"],
        ["eval", "--model", "smollm2-135m", "--task", "needl", "--out", "/nonexistent"],
        ["eval", "--model", "smollm2-135m", "--task", "needle", "--methods", "full,snapk", "--out", "/nonexistent"],
        ["eval", "--model", "smollm2-135m", "--task", "needle", "--rag", "naiv", "--out", "/nonexistent"],
        ["rag", "--docs", __file__, "--question", "q", "--aux-model", "smollm2-136m"],
    ],
)
def test_cli_name_mistakes_fail_without_importing_torch(argv):
    code = (
        "import sys; from kvforge.cli import main\n"
        f"code = main({argv!r})\n"
        "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["2", "False", "False"]
    assert "did you mean" in done.stderr or "unknown" in done.stderr or "key=value" in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_a_closed_pipe_is_no_traceback():
    import os

    env = dict(os.environ)
    done = subprocess.run(f"{sys.executable} -m kvforge presses | head -1", shell=True, capture_output=True, text=True,
                          env=env)  # fmt: skip
    assert done.stdout.startswith("full") and "Traceback" not in done.stderr
