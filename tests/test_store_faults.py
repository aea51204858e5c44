"""Store faults: passwords never in any output, odd store URLs are one-line errors, a hung or dead Redis is a miss."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from pathlib import Path

import pytest
from store_helpers import free_port, make_segment, redis_server

from kvforge.cli import main
from kvforge.errors import StoreUnavailableError, UserError
from kvforge.redact import redact_url
from kvforge.store import DiskStore, open_store
from kvforge.store.codec import encode, segments_equal

SECRET = "s3cr3t-Pa55"


def _down_redis(password: str = SECRET) -> str:
    return f"redis://:{password}@127.0.0.1:{free_port()}/0"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:6379/0", "redis://***@h:6379/0"),
        ("redis://user:pw@h/1,file:///x", "redis://***@h/1,file:///x"),
        ("rediss://pw@h/0", "rediss://***@h/0"),
        ("redis://h/0?password=pw&prefix=a", "redis://h/0?password=***&***"),  # what follows may be the password
        ("memory://?max_bytes=1GB", "memory://?max_bytes=1GB"),
        ("file:///tmp/kv", "file:///tmp/kv"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("command", ["ls", "stats", "clear"])
def test_cache_commands_never_print_the_password(command: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["cache", command, "--store", _down_redis()]) == 2
    out, err = capsys.readouterr()
    assert SECRET not in out + err and "***@127.0.0.1" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_help_never_shows_the_password_of_the_default_store(monkeypatch, capsys) -> None:
    monkeypatch.setenv("KVFORGE_STORE", _down_redis())
    assert main(["cache", "ls", "--help"]) == 0
    assert SECRET not in capsys.readouterr().out


def test_tiered_warning_never_shows_the_password(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        store = open_store(f"memory://,file://{tmp_path}/kv,{_down_redis()}")
        store.put("aa", make_segment())
        assert store.get("aa") is not None
    assert caplog.records and all(SECRET not in r.getMessage() for r in caplog.records)
    assert SECRET not in str(store.stats()) and SECRET not in repr(store.tiers[2])


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("memory://?max_bytes=1e400", "out of range"),
        ("memory://?max_bytes=-5", "invalid size"),
        ("file://rel/path", "absolute path"),
        ("file://../rel", "absolute path"),
        ("redis://127.0.0.1:6379/abc", "database must be a number"),
        ("redis://127.0.0.1:99999/0", "bad store URL"),
        ("redis://127.0.0.1:6379/0?socket_timout=1", "unknown option 'socket_timout'"),
        ("redis://127.0.0.1:6379/0?timeout=nan", "timeout must be in"),
        ("file:///tmp/x?fsync=maybe", "expected a boolean"),
    ],
)
def test_odd_store_urls_are_one_line_errors(url: str, message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        open_store(url)
    assert main(["cache", "stats", "--store", url]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1


def test_redis_db_out_of_range_is_a_clear_error(tmp_path: Path) -> None:
    with redis_server(tmp_path) as url, pytest.raises(StoreUnavailableError, match="refused the connection"):
        open_store(url.rsplit("/", 1)[0] + "/99")


def test_disk_store_validates_keys_in_every_method(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "kv")
    for method in (store.get, store.contains, store.delete, store.touch, store.get_blob):
        with pytest.raises(ValueError, match="key"):
            method("../escape")


def test_a_hung_redis_is_a_miss_within_the_timeout(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGSTOP'd redis-server: reads are misses and writes are skipped after the socket timeout, with ONE warning
    per outage and one when it answers again; no call stalls."""
    import subprocess

    with redis_server(tmp_path) as url:
        store = open_store(url + "?timeout=0.5&connect_timeout=0.5&prefix=hung")
        store.put("aa", make_segment())
        pid = int(subprocess.run(["pgrep", "-f", f"redis-server 127.0.0.1:{url.split(':')[2].split('/')[0]}"],
                                 capture_output=True, text=True).stdout.split()[0])  # fmt: skip
        os.kill(pid, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING):
                start = time.monotonic()
                assert store.get("aa") is None
                store.put("bb", make_segment(seed=1))
                assert store.get("bb") is None and not store.contains("aa")
                elapsed = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
        assert elapsed < 5  # ONE 0.5 s timeout: later calls of the outage answer at once (not redis-py's no timeout)
        assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
        store.retry_s = 0.0  # ask again at once: it answers
        with caplog.at_level(logging.WARNING):
            assert segments_equal(store.get("aa"), make_segment())
        assert any("available again" in r.getMessage() for r in caplog.records)
        store.clear()


def test_server_answers_without_reuse_when_its_store_is_down(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kvforge.engine import Engine
    from kvforge.serve import create_app
    from kvforge.testing import tiny_model, tiny_tokenizer

    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    with pytest.raises(StoreUnavailableError, match=r"\*\*\*@") as exc:  # a default reuse needs its store at start
        create_app(engine, model_name="tiny", store_url=_down_redis(), reuse="prefix")
    assert SECRET not in str(exc.value)
    app = create_app(engine, model_name="tiny", store_url=_down_redis())
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2,
            "kvforge": {"reuse": "prefix"}}  # fmt: skip
    with caplog.at_level(logging.DEBUG), TestClient(app) as client:
        for _ in range(2):
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        docs = client.post("/v1/kv/documents", json={"documents": ["some text"]})
        metrics = client.get("/metrics").text
    assert docs.status_code == 503 and docs.json()["error"]["message"] == "store unavailable", docs.text
    assert all(SECRET not in text for text in (r.text, docs.text, metrics))
    assert all(SECRET not in rec.getMessage() for rec in caplog.records)


def test_read_only_disk_store_serves_hits_and_skips_writes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = f"file://{tmp_path}/kv"
    open_store(url).put("aa", make_segment())
    store = open_store(url + "?read_only=1")
    assert segments_equal(store.get("aa"), make_segment())
    store.put("bb", make_segment(seed=1))
    store.delete("aa")
    assert store.get("bb") is None and store.contains("aa")
    result = store.clear()
    assert result.removed == 0 and list(result.failed) == ["aa"] and "read-only" in result.failed["aa"]
    assert main(["cache", "clear", "--store", url + "?read_only=1"]) == 1
    out, err = capsys.readouterr()
    assert "cleared 0 entries" in out and "could not delete 1 entries" in err and "read-only" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert open_store(url).contains("aa")


def test_a_folder_that_refuses_writes_serves_hits_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """EROFS at os.open (a real read-only mount: tests/test_store_os_faults.py): writes skipped, one warning, hits."""
    import errno

    import kvforge.store.disk as disk

    store = DiskStore(tmp_path / "kv")
    store.put("aa", make_segment())
    real_open = os.open

    def refuse(path, flags, *args):  # type: ignore[no-untyped-def]
        if flags & os.O_WRONLY:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(disk.os, "open", refuse)
    with caplog.at_level(logging.WARNING):
        for seed in range(3):
            store.put(f"b{seed}", make_segment(seed=seed))
        assert segments_equal(store.get("aa"), make_segment())
    assert not store.contains("b0") and not list((tmp_path / "kv" / "tmp").iterdir())
    assert len([r for r in caplog.records if "Read-only file system [EROFS]" in r.getMessage()]) == 1


def test_redis_chunks_of_an_uncommitted_write_expire(tmp_path: Path) -> None:
    """Data chunks are written with a TTL that the metadata write clears: a writer killed between the two leaves
    chunks that expire, never orphans forever."""
    import redis

    from kvforge.store.redis import ORPHAN_TTL_S, RedisStore

    with redis_server(tmp_path) as url:
        store = RedisStore(url, chunk_bytes=1000, prefix="ttl")
        store.put("aa", make_segment())
        client = redis.Redis.from_url(url)
        chunks = [k for k in client.keys("ttl:seg:aa:data:*")]
        assert len(chunks) > 1 and all(client.ttl(k) == -1 for k in chunks)  # committed: no expiry
        real_commit = store._commit_script

        def dies_before_commit(**kw):  # type: ignore[no-untyped-def]  # the writer is killed after its data chunks
            raise redis.exceptions.ConnectionError("killed")

        store._commit_script = dies_before_commit  # type: ignore[method-assign]
        store.put("bb", make_segment(seed=1))  # a miss-with-warning for the caller
        store._commit_script = real_commit  # type: ignore[method-assign]
        store.retry_s = 0.0  # the failed write marked Redis down for a while: ask again at once
        orphans = client.keys("ttl:seg:bb:data:*")
        assert orphans and all(0 < client.ttl(k) <= ORPHAN_TTL_S for k in orphans) and store.get("bb") is None
        assert segments_equal(store.get("aa"), make_segment())


def test_partial_writes_left_by_a_killed_writer_count_against_max_bytes(tmp_path: Path) -> None:
    size = len(encode(make_segment()))
    store = DiskStore(tmp_path / "kv", max_bytes=3 * size, rescan_s=0.0)
    store.put("aa", make_segment())
    store.put("bb", make_segment(seed=1))
    (tmp_path / "kv" / "tmp" / "cc.123.dead.tmp").write_bytes(b"x" * size)  # what kill -9 mid-write leaves
    store.put("dd", make_segment(seed=2))  # 3 entries + the partial write > 3 entries: the oldest goes
    assert not store.contains("aa") and store.contains("bb") and store.contains("dd")
    assert store.stats()["tmp_bytes"] == size
    old = time.time() - 2 * 3600
    os.utime(tmp_path / "kv" / "tmp" / "cc.123.dead.tmp", (old, old))
    assert DiskStore(tmp_path / "kv", max_bytes=3 * size).stats()["tmp_bytes"] == 0  # removed by age on open
