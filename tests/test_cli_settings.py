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
