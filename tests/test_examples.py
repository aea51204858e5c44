"""Every script in examples/ runs on a tiny model folder (no download)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script, tiny_llama_dir):
    if script.stem == "serve_client":
        pytest.importorskip("fastapi", reason="the serve extra is not installed")
        pytest.importorskip("openai", reason="the openai client is not installed")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(script), str(tiny_llama_dir)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2
    if script.stem == "quickstart":  # the first question stores the compressed document, the second loads it
        assert " 0 of " in lines[0] and " 0 of " not in lines[1]
    if script.stem == "store_reuse":  # the second question reuses the stored document
        assert "reused 0 of" in lines[0] and "reused 0 of" not in lines[1]
    if script.stem == "serve_client":  # greedy: the streamed answer is the plain one
        assert lines[0].startswith("chat: ") and lines[1].startswith("stream: ")
        assert lines[0].rpartition(" (")[0].removeprefix("chat: ") == lines[1].removeprefix("stream: ")
    if script.stem == "rag_chunks":  # the second question finds every chunk stored, in another order
        assert "chunk misses 6" in lines[0] and "chunk misses 0" in lines[1]
    if script.stem == "compress_generate":  # the press keeps about half of the entries
        full, small = (int(line.split(":")[1].split()[0]) for line in lines)
        assert small < 0.6 * full
