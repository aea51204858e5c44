"""Model loading, fingerprints and the CLI's error handling (tiny model saved to a folder: no download)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvforge.cli import main
from kvforge.errors import UserError
from kvforge.model import load_model, model_fingerprint
from kvforge.testing import tiny_model


def test_load_local_folder_and_fingerprint_is_stable(tiny_llama_dir):
    model, tokenizer = load_model(str(tiny_llama_dir), device="cpu")
    assert model.config._attn_implementation != "kvforge"  # kvforge switches it only inside its own calls
    fp = model_fingerprint(model, tokenizer)
    assert fp.startswith("LlamaForCausalLM:") and fp.endswith(":float32")
    code = (
        "from kvforge.model import load_model, model_fingerprint;"
        f"m, t = load_model({str(tiny_llama_dir)!r}, device='cpu'); print(model_fingerprint(m, t))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == fp
    different = tiny_model("llama", seed=1)
    assert model_fingerprint(different, tokenizer) != fp


def test_unknown_model_and_missing_file():
    with pytest.raises(UserError, match="unknown model"):
        load_model("no-such-model")
    with pytest.raises(UserError, match="not found"):
        load_model("/nonexistent/model.gguf")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--model", "no-such-model", "--prompt", "hi"], "unknown model"),
        (["generate", "--model", "TINY", "--prompt-file", "/nonexistent.txt"], "file not found"),
        (["generate", "--model", "TINY", "--prompt", "x" * 3000], "exceeds the model's context"),
    ],
)
def test_cli_errors_are_one_line(argv, message, tiny_llama_dir, capsys):
    argv = [str(tiny_llama_dir) if a == "TINY" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_cli_rejects_invalid_numbers(capsys):
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "-3"]) == 2
    err = capsys.readouterr().err
    assert "must be >= 1" in err and err.count("\n") == 1 and "usage:" not in err


def test_cli_generate_streams_to_stdout_and_timings_to_stderr(tiny_llama_dir, capsys):
    assert main(["generate", "--model", str(tiny_llama_dir), "--prompt", "hello", "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert "TTFT" in err and "tok/s" in err and "TTFT" not in out
    argv = ["generate", "--model", str(tiny_llama_dir), "--prompt", "hello", "--max-new-tokens", "5"]
    assert main([*argv, "--no-cache"]) == 0
    out_nc, _ = capsys.readouterr()
    assert out_nc.strip() == out.strip()  # greedy: the no-cache baseline gives the same text


def test_help_and_version_do_not_import_torch():
    code = (
        "import sys; from kvforge.cli import main\n"
        "for argv in (['--version'], ['--help'], ['generate', '--help'], ['eval', '--help']):\n"
        "    try: main(argv)\n"
        "    except SystemExit: pass\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "kvforge 0.1.0" in out and out.strip().endswith("False")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt", "hi", "--press", "snapk"], "unknown press 'snapk'; did you mean 'snapkv'?"),
        (
            ["eval", "--model", "smollm2-135m", "--task", "nedle", "--out", "OUT"],
            "unknown task 'nedle'; did you mean 'needle'",
        ),
        (
            ["eval", "--model", "smollm2-135m", "--task", "needle", "--methods", "criticalk", "--out", "OUT"],
            "'criticalkv'",
        ),
        (  # a data folder without longbench/ now falls back to the bundled sample (tests/test_eval_samples.py)
            ["eval", "--model", "smollm2-135m", "--task", "squad", "--compression-ratios", "1.5", "--out", "OUT"],
            "--compression-ratios must lie in (0, 1)",
        ),
        (["generate", "--model", "smollm2-135", "--prompt", "hi"], "did you mean 'smollm2-135m'"),
    ],
)
def test_mistakes_fail_before_the_model_loads_with_a_suggestion(argv, message, tmp_path, monkeypatch, capsys):
    import kvforge.commands.eval as eval_cmd
    import kvforge.commands.generate as generate_cmd

    def no_load(*_a, **_k):
        raise AssertionError("the model was loaded before the arguments were checked")

    if "smollm2-135" not in argv:
        monkeypatch.setattr(generate_cmd, "load", no_load)
        monkeypatch.setattr(eval_cmd, "load_engine", no_load)
    argv = [str(tmp_path) if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_fingerprint_follows_weight_changes(tiny_llama_dir):
    import torch

    model, tokenizer = load_model(str(tiny_llama_dir), device="cpu")
    fp = model_fingerprint(model, tokenizer)
    assert model_fingerprint(model, tokenizer) == fp
    model.to(torch.bfloat16)
    bf16 = model_fingerprint(model, tokenizer)
    assert bf16 != fp and bf16.endswith(":bfloat16")
    model.to(torch.float32)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # in place: same storage, new version counter
    changed = model_fingerprint(model, tokenizer)
    assert changed != fp and changed.split(":")[1] != fp.split(":")[1]
