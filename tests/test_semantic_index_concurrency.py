"""The semantic index never loses an entry: two processes recording into one store, restarts, damaged or deleted
records (rebuilt from the stored segments' headers), a writer that stored its KV but not its record."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
        found = reuse.lookup(text)
        assert not isinstance(found, str), (text, found)
        assert found[1].text == text and found[0] > 0.999
    return reuse


def _damage_records(url: str, flip: Callable[[str], None]) -> list[str]:
    """Delete every third index record, flip a byte inside four others; returns the records that were touched."""
    store = open_store(url)
    keys = sorted(SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)._records)
    assert len(keys) == 50
    for key in keys[::3]:
        store.delete_blob(key)
    for key in keys[1:12:3]:
        flip(key)
    return keys[::3] + keys[1:12:3]


def _check_rebuilt(url: str, touched: list[str]) -> None:
    reuse = _check_all_indexed(url)  # all 50 found again, from the segments' headers
    assert all(key in reuse._records and reuse._records[key] is not None for key in touched)
    again = _check_all_indexed(url)  # and the records were written again: the next instance reads them as records
    assert again._records.keys() == reuse._records.keys()


def test_two_processes_recording_into_one_file_store_lose_nothing(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/kv"
    _record_concurrently(url, tmp_path)
    _check_all_indexed(url)

    def flip(key: str) -> None:
        path = tmp_path / "kv" / "blobs" / f"{key}.blob"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x20
        path.write_bytes(bytes(data))

    _check_rebuilt(url, _damage_records(url, flip))


@pytest.mark.redis
def test_two_processes_recording_into_one_redis_lose_nothing(tmp_path: Path) -> None:
    import redis

    with redis_server(tmp_path) as url:
        _record_concurrently(url, tmp_path)
        _check_all_indexed(url)
        client = redis.Redis.from_url(url)

        def flip(key: str) -> None:
            name = client.keys(f"kvforge:blob:{key}:data:*")[0]
            data = bytearray(client.get(name))
            data[len(data) // 2] ^= 0x20
            client.set(name, bytes(data))

        _check_rebuilt(url, _damage_records(url, flip))


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
        assert all(not isinstance(reuse.lookup(t), str) for t in texts)
        assert len(reuse.index) == 6
    victim = sorted(a._records)[0]
    store.put_blob(victim, b"garbage")
    with caplog.at_level(logging.WARNING):
        reopened = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)
    assert any("skipped" in r.getMessage() for r in caplog.records)
    assert len(reopened.index) == 6 and all(not isinstance(reopened.lookup(t), str) for t in texts)
    assert store.get_blob(victim) != b"garbage"  # the record was written again from the segment


class _DiesBeforeItsRecord:
    """A store through which a writer stores its KV and is killed before its index record (put_blob) is written."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def put_blob(self, key: str, data: bytes) -> None:
        pass


def test_kv_stored_without_its_record_is_indexed_by_the_next_write_or_open(tmp_path: Path) -> None:
    from kvforge.cache import KVCache
    from kvforge.prefill import prefill
    from kvforge.testing import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    store = open_store(f"file://{tmp_path}/kv")

    def record(reuse: SemanticReuse, text: str) -> None:
        ids = tok(text, add_special_tokens=False).input_ids
        cache = KVCache.for_model(model)
        prefill(model, ids, cache)
        reuse.record(ids, cache, text=text)

    survivor = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6, reconcile_s=3600)
    killed = SemanticReuse(_DiesBeforeItsRecord(store), "tiny", FakeEmbedder(), threshold=0.6)
    lost = ["the killed writer stored this first prompt", "and a second prompt before dying"]
    for text in lost:
        record(killed, text)
    assert len(store.keys()) == 2 and store.blob_keys() == []  # KV stored, no index record
    assert isinstance(survivor.lookup(lost[0]), str)  # unseen until the next write (reconcile_s is long here)
    record(survivor, "the survivor writes one prompt of its own")
    assert len(survivor.index) == 3 and all(not isinstance(survivor.lookup(t), str) for t in lost)
    assert len(store.blob_keys()) == 3  # the lost records were written again
    store.delete_blob(sorted(store.blob_keys())[0])
    fresh = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)  # on open as well
    assert len(fresh.index) == 3 and len(store.blob_keys()) == 3


def test_rebuild_ignores_other_models_and_modes(tmp_path: Path) -> None:
    from kvforge.cache import KVCache
    from kvforge.prefill import prefill
    from kvforge.testing import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    store = open_store(f"file://{tmp_path}/kv")
    text = "a prompt recorded by another model"
    ids = tok(text, add_special_tokens=False).input_ids
    cache = KVCache.for_model(model)
    prefill(model, ids, cache)
    SemanticReuse(store, "other-model", FakeEmbedder(), threshold=0.6).record(ids, cache, text=text)
    for key in store.blob_keys():
        store.delete_blob(key)
    mine = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)
    assert len(mine.index) == 0 and store.blob_keys() == [] and len(mine._unindexable) == 1
    assert len(SemanticReuse(store, "other-model", FakeEmbedder(), threshold=0.6).index) == 1


@pytest.mark.redis
def test_semantic_reuse_on_a_hung_redis_neither_raises_nor_stalls(tmp_path: Path) -> None:
    """SIGSTOP'd Redis (timeout 0.5 s): opening an instance, recording and searching cost one timeout, not one per
    call (the rebuild's listing goes through the store's one-warning outage handling too)."""
    import os
    import signal
    import time

    from kvforge.cache import KVCache
    from kvforge.prefill import prefill
    from kvforge.testing import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    with redis_server(tmp_path) as url:
        store = open_store(url + "?timeout=0.5&connect_timeout=0.5")
        port = url.split(":")[2].split("/")[0]
        out = subprocess.run(["pgrep", "-f", f"redis-server 127.0.0.1:{port}"], capture_output=True, text=True)
        pid = int(out.stdout.split()[0])
        texts = [f"hung redis question {i}" for i in range(3)]
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            reuse = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)
            for text in texts:
                ids = tok(text, add_special_tokens=False).input_ids
                cache = KVCache.for_model(model)
                prefill(model, ids, cache)
                reuse.record(ids, cache, text=text)
                assert reuse.plan(ids, text=text) is not None
            elapsed = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
        assert elapsed < 4, elapsed
        store.retry_s = 0.0
        assert len(SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6).index) == 0  # nothing was written
