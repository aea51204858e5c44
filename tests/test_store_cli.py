"""``kvforge cache ls|stats|clear`` through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from store_helpers import free_port, make_segment

from kvforge import cli
from kvforge.store import open_store


def test_cache_ls_stats_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/kv"
    store = open_store(url)
    store.put("ab01", make_segment(model_id="smollm2-135m-abcdef123456"))
    store.put("cd02", make_segment(lengths=(5,), meta={}))
    store.put_blob("index", b"x")

    assert cli.main(["cache", "ls", "--store", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["KEY", "TOKENS", "BYTES", "MODEL", "PRESS", "QUANT"]
    ab01 = next(line for line in lines if line.startswith("ab01")).split()
    assert ab01[1] == "7" and ab01[4] == "smollm2-135m" and ab01[5] == "snapkv(0.5)" and ab01[6] == "-"

    assert cli.main(["cache", "ls", "--json", "--store", url]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["key"]: r["num_tokens"] for r in rows} == {"ab01": 7, "cd02": 5}

    assert cli.main(["cache", "stats", "--store", url]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 2 and stats["tokens"] == 12 and stats["blobs"] == 1 and stats["backend"] == "file"
    assert stats["by_press"] == {"snapkv": 1, "none": 1} and stats["bytes"] == stats["stored_bytes"]

    assert cli.main(["cache", "clear", "--store", url]) == 0
    assert "cleared 3 entries" in capsys.readouterr().out  # 2 segments + 1 blob
    assert open_store(url).keys() == [] and open_store(url).get_blob("index") is None


def test_cache_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["cache", "stats", "--store", "s3://bucket"]) == 2
    assert "supported are memory://, file://" in capsys.readouterr().err
    assert cli.main(["cache", "ls", "--store", f"redis://127.0.0.1:{free_port()}/0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvforge: error: Redis store") and err.count("\n") == 1
