"""``kvforge rag`` on a tiny model saved to a folder."""

import argparse

import pytest

from kvforge.cli import main
from kvforge.commands import rag as rag_command
from kvforge.errors import UserError


@pytest.fixture()
def docs(tmp_path):
    files = []
    for i, text in enumerate(["The code is 7731.", "Paris is in France.", "Cats sleep a lot."]):
        f = tmp_path / f"doc{i}.txt"
        f.write_text(text)
        files.append(str(f))
    return files


def run(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    rag_command.register(sub, None)
    args = parser.parse_args(["rag", *argv])
    return args.func(args)


def test_registered_in_the_cli(tiny_llama_dir, docs, tmp_path, capsys):
    store = f"file://{tmp_path / 'kv'}"
    argv = [
        "rag",
        "--model",
        str(tiny_llama_dir),
        "--docs",
        *docs,
        "--question",
        "Code?",
        "--strategy",
        "cacheclip",
        "--store",
        store,
        "--max-new-tokens",
        "2",
    ]
    assert main(argv) == 0
    assert "chunk_misses=3" in capsys.readouterr().err
    assert main(argv) == 0  # second run: chunks come from the disk store
    err = capsys.readouterr().err
    assert "chunk_misses=0" in err and "chunk_hits=0" not in err
    assert main(["rag", "--model", str(tiny_llama_dir), "--docs", str(tmp_path / "nope.txt"), "--question", "q"]) == 2


@pytest.mark.parametrize("strategy", ["full", "naive", "ape", "cacheblend", "cacheclip", "epic", "epic-ape"])
def test_rag_command_answers_and_reports(tiny_llama_dir, docs, strategy, capsys):
    argv = [
        "--model",
        str(tiny_llama_dir),
        "--docs",
        *docs,
        "--question",
        "What is the code?",
        "--strategy",
        strategy,
        "--recompute-ratio",
        "0.5",
        "--max-new-tokens",
        "4",
    ]
    assert run(argv) == 0
    err = capsys.readouterr().err
    assert f"strategy={strategy}" in err and "ttft=" in err and "reused=" in err and "recomputed=" in err
    if strategy in ("naive", "ape"):
        assert "recomputed=0 " in err and "chunk_misses=3" in err


def test_rag_command_errors(tiny_llama_dir, docs, tmp_path):
    with pytest.raises(SystemExit):  # a missing file is refused while the arguments are parsed
        run(["--model", str(tiny_llama_dir), "--docs", str(tmp_path / "missing.txt"), "--question", "q"])
    with pytest.raises(UserError, match="recompute-ratio"):
        run(["--model", str(tiny_llama_dir), "--docs", *docs, "--question", "q", "--recompute-ratio", "2"])
    with pytest.raises(UserError, match="aux-model"):
        run(
            [
                "--model",
                str(tiny_llama_dir),
                "--docs",
                *docs,
                "--question",
                "q",
                "--strategy",
                "naive",
                "--aux-model",
                str(tiny_llama_dir),
            ]
        )
