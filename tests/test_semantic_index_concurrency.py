"""The semantic index never loses an entry: two processes recording into one store, restarts, damaged records."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from store_helpers import redis_server

pytest.importorskip("faiss")

from kvforge.reuse import FakeEmbedder, SemanticReuse
from kvforge.store import open_store

WRITER = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    from kvforge.cache import KVCache
    from kvforge.prefill import prefill
    from kvforge.reuse import FakeEmbedder, SemanticReuse
    from kvforge.store import open_store
    from kvforge.testing import tiny_model, tiny_tokenizer

    url, who = sys.argv[1], sys.argv[2]
    model, tok = tiny_model("llama"), tiny_tokenizer()
    reuse = SemanticReuse(open_store(url), "tiny", FakeEmbedder(), threshold=0.6)
    for i in range(25):
        text = f"writer {who} asks question number {i} about topic {i * 7 % 13}"
        ids = tok(text, add_special_tokens=False).input_ids
        cache = KVCache.for_model(model)
        prefill(model, ids, cache)
        reuse.record(ids, cache, text=text)
    """
)


def _texts() -> list[str]:
    return [f"writer {w} asks question number {i} about topic {i * 7 % 13}" for w in "AB" for i in range(25)]


def _record_concurrently(url: str, tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    procs = [subprocess.Popen([sys.executable, str(script), url, who]) for who in "AB"]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]


def _check_all_indexed(url: str) -> SemanticReuse:
    reuse = SemanticReuse(open_store(url), "tiny", FakeEmbedder(), threshold=0.6)
    assert len(reuse.index) == 50
    for text in _texts():
        found = reuse._find(text, "")
        assert not isinstance(found, str), (text, found)
        assert found[1].text == text and found[0] > 0.999
    return reuse


def test_two_processes_recording_into_one_file_store_lose_nothing(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/kv"
    _record_concurrently(url, tmp_path)
    _check_all_indexed(url)


@pytest.mark.redis
def test_two_processes_recording_into_one_redis_lose_nothing(tmp_path: Path) -> None:
    with redis_server(tmp_path) as url:
        _record_concurrently(url, tmp_path)
        _check_all_indexed(url)


def test_long_lived_instances_see_each_others_entries_and_a_damaged_record_costs_one_entry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvforge.cache import KVCache
    from kvforge.prefill import prefill
    from kvforge.testing import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    store = open_store(f"file://{tmp_path}/kv")
    a, b = (SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6) for _ in range(2))
    texts = [f"instance question {i} on subject {i}" for i in range(6)]
    for i, text in enumerate(texts):  # taking turns, each with its own in-memory index
        ids = tok(text, add_special_tokens=False).input_ids
        cache = KVCache.for_model(model)
        prefill(model, ids, cache)
        (a if i % 2 else b).record(ids, cache, text=text)
    for reuse in (a, b):
        assert all(not isinstance(reuse._find(t, ""), str) for t in texts)
        assert len(reuse.index) == 6
    victim = sorted(a._records)[0]
    store.put_blob(victim, b"garbage")
    with caplog.at_level(logging.WARNING):
        reopened = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)
    assert len(reopened.index) == 5 and any("skipped" in r.getMessage() for r in caplog.records)
