"""Redis store against a real redis-server (started on 127.0.0.1 on a free port), and tiers degrading without it."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from store_helpers import free_port, make_segment, redis_chunk_audit, redis_server

from kvforge.errors import StoreUnavailableError
from kvforge.store import DiskStore, MemoryStore, TieredStore, open_store
from kvforge.store.codec import encode, segments_equal

pytestmark = pytest.mark.redis
redis = pytest.importorskip("redis", reason="the redis client is not installed (pip install 'kvforge[store]')")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def rstore(redis_url: str):  # type: ignore[no-untyped-def]
    from kvforge.store.redis import RedisStore

    store = RedisStore(redis_url, chunk_bytes=1000)  # small chunks: every entry is split
    store.client.flushdb()
    yield store
    store.close()


def test_round_trip_in_chunks(rstore) -> None:  # type: ignore[no-untyped-def]
    seg = make_segment(torch.bfloat16, lengths=(40, 20, 0))
    size = len(encode(seg))
    rstore.put("ab01", seg)
    chunks = rstore.client.keys("kvforge:seg:ab01:data:*")
    assert len(chunks) == -(-size // 1000) > 3
    assert max(len(rstore.client.get(k)) for k in chunks) == 1000
    assert segments_equal(rstore.get("ab01"), seg)
    assert rstore.contains("ab01") and rstore.keys() == ["ab01"]
    assert rstore.describe("ab01")["num_tokens"] == 40 and rstore.describe("ab01")["stored_bytes"] == size
    stats = rstore.stats(deep=True)
    assert stats["entries"] == 1 and stats["bytes"] == size and stats["hits"] == 1 and stats["tokens"] == 40


def test_overwrite_and_delete_leave_no_chunks(rstore) -> None:  # type: ignore[no-untyped-def]
    rstore.put("ab01", make_segment(seed=1))
    rstore.put("ab01", make_segment(seed=2, lengths=(3,)))
    assert segments_equal(rstore.get("ab01"), make_segment(seed=2, lengths=(3,)))
    nonce = rstore._meta("ab01", "seg")["nonce"]
    assert all(nonce.encode() in k for k in rstore.client.keys("kvforge:seg:ab01:data:*"))
    rstore.put_blob("index", b"blob" * 600)
    assert rstore.get_blob("index") == b"blob" * 600
    rstore.delete("ab01")
    rstore.clear()
    assert rstore.client.keys("kvforge:*") == []


def test_half_written_entry_is_a_miss(rstore, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    def dies(**kwargs):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt  # the data went in; the process dies before its commit

    monkeypatch.setattr(rstore, "_commit_script", dies)
    with pytest.raises(KeyboardInterrupt):
        rstore.put("ab01", make_segment())
    monkeypatch.undo()
    assert rstore.client.keys("kvforge:seg:ab01:data:*")  # the chunks are there ...
    assert rstore.get("ab01") is None and not rstore.contains("ab01") and rstore.keys() == []  # ... but unseen


def test_lost_chunk_is_a_miss_and_removed(rstore, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    rstore.put("ab01", make_segment())
    rstore.client.delete(sorted(rstore.client.keys("kvforge:seg:ab01:data:*"))[1])  # e.g. dropped by maxmemory
    with caplog.at_level(logging.WARNING):
        assert rstore.get("ab01") is None
    assert "lost part of its data" in caplog.text and not rstore.contains("ab01")
    assert rstore.client.keys("kvforge:seg:ab01:*") == []


def test_corrupt_value_is_a_miss(rstore, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    rstore.put("ab01", make_segment())
    last = sorted(rstore.client.keys("kvforge:seg:ab01:data:*"), key=lambda k: int(k.rsplit(b":", 1)[1]))[-1]
    value = bytearray(rstore.client.get(last))
    value[-1] ^= 0xFF
    rstore.client.set(last, bytes(value))
    assert rstore.get("ab01") is None and "corrupt" in caplog.text and not rstore.contains("ab01")


def test_lru_eviction_and_sharing_between_clients(redis_url: str) -> None:
    from kvforge.store.redis import RedisStore

    size = len(encode(make_segment()))
    a = RedisStore(redis_url, max_bytes=int(size * 2.5), prefix="lru")
    a.clear()
    b = RedisStore(redis_url, prefix="lru")  # another process or machine
    a.put("aa", make_segment())
    a.put("bb", make_segment())
    assert segments_equal(b.get("aa"), make_segment())  # b's read refreshes aa: bb is now least recent
    a.put("cc", make_segment())
    assert sorted(b.keys()) == ["aa", "cc"] and a.stats()["evictions"] == 1
    assert a.stats()["bytes"] == 2 * size
    a.clear()


def test_open_store_redis_url(redis_url: str) -> None:
    store = open_store(redis_url + "?chunk_bytes=4KiB&prefix=t1&max_bytes=1MB")
    assert store.chunk_bytes == 4096 and store.prefix == "t1" and store.max_bytes == 1_000_000
    store.put("aa", make_segment())
    assert segments_equal(open_store(redis_url + "?prefix=t1").get("aa"), make_segment())
    store.clear()


def test_redis_refused_is_a_clear_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailableError, match=r"Redis store redis://127.0.0.1:\d+/0 is unavailable"):
        open_store(url)


def test_tiered_degrades_with_one_warning_when_redis_is_down(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = f"memory://,file://{tmp_path}/kv,redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING):
        store = open_store(url)
        for i in range(5):
            store.put(f"k{i}", make_segment(seed=i))
            assert segments_equal(store.get(f"k{i}"), make_segment(seed=i))
        assert store.contains("k1") and sorted(store.keys()) == [f"k{i}" for i in range(5)]
        stats = store.stats()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tier 2 (redis) is unavailable" in warnings[0].getMessage()
    assert stats["tiers"][2] == {"backend": "redis", "available": False} and stats["entries"] == 5


def test_tiered_survives_redis_going_down(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from kvforge.store.redis import RedisStore

    with redis_server(tmp_path) as url:
        redis_tier = RedisStore(url, chunk_bytes=2000)
        store = TieredStore([MemoryStore(), DiskStore(tmp_path / "kv"), redis_tier], retry_s=0.0)
        store.put("aa", make_segment())
        store.tiers[0].clear()
        store.tiers[1].clear()
        assert segments_equal(store.get("aa"), make_segment()) and store.tier_hits == [0, 0, 1]  # from Redis
        assert store.tiers[0].contains("aa")  # promoted into memory at once ...
        store.flush()
        assert store.tiers[1].contains("aa")  # ... and into the disk tier in the background
    with caplog.at_level(logging.WARNING):  # the server is gone now
        for _ in range(3):
            store.put("bb", make_segment(seed=3))
            assert segments_equal(store.get("bb"), make_segment(seed=3)) and store.get("zz") is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "redis" in warnings[0].getMessage()


WRITER = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    from store_helpers import make_segment
    from kvforge.store.redis import RedisStore

    store = RedisStore(sys.argv[1], chunk_bytes=64 * 1024, prefix="sk")
    print("ready", flush=True)
    i = 0
    while True:  # overwrites (old chunks dropped by the commit), deletes and new entries, until killed
        store.put(f"k{i % 5}", make_segment(seed=i, lengths=(600, 300), num_heads=4, head_dim=64))
        if i % 3 == 2:
            store.delete(f"k{(i + 2) % 5}")
        store.put_blob(f"b{i % 3}", bytes(range(256)) * (400 + i))
        i += 1
    """
)


def test_a_writer_killed_with_sigkill_leaves_no_partial_entry_and_no_keys_without_ttl(tmp_path: Path) -> None:
    """A real writer process SIGKILLed at random moments, several times, on a real redis-server: every entry that is
    visible reads back whole (checksum verified), and every data key is either pointed to by a metadata record (no
    TTL) or expires (TTL set): no orphans forever, no half entries."""
    import random
    import signal
    import subprocess
    import sys
    import time

    from kvforge.store.redis import ORPHAN_TTL_S, RedisStore

    rng = random.Random(0)
    with redis_server(tmp_path) as url:
        script = tmp_path / "writer.py"
        script.write_text(WRITER)
        killed_mid_data = 0
        for _ in range(6):
            proc = subprocess.Popen([sys.executable, str(script), url, str(Path(__file__).parent)],
                                    stdout=subprocess.PIPE, text=True)  # fmt: skip
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.1, 1.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            live, data, ttls = redis_chunk_audit(url, "sk")
            assert live <= data  # every committed entry has all its chunks
            for name, ttl in ttls.items():
                assert (ttl == -1) if name in live else (0 < ttl <= ORPHAN_TTL_S), (name, ttl)
            killed_mid_data += bool(data - live)
            metas = [k.decode() for k in redis.Redis.from_url(url).scan_iter("sk:*:meta")]
            store = RedisStore(url, prefix="sk")
            seg_keys = sorted(k.split(":")[2] for k in metas if k.startswith("sk:seg:"))
            blob_keys = sorted(k.split(":")[2] for k in metas if k.startswith("sk:blob:"))
            assert sorted(store.keys()) == seg_keys and sorted(store.blob_keys()) == blob_keys  # sizes/LRU agree
            for key in seg_keys:
                seg = store.get(key)
                assert seg is not None and seg.num_tokens == 600
            for key in blob_keys:
                assert store.get_blob(key) is not None
            assert store.num_corrupt == 0
        assert seg_keys  # the writer got somewhere
    print(f"killed while data chunks were in flight: {killed_mid_data} of 6")
