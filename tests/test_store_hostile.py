"""A store that others can write is bounded input: FIFOs, devices and links are never followed nor read, declared
sizes are checked against limits before anything is allocated, names read from a store are validated, and a bad
entry is a miss with one warning, never a hang, an exception or a file touched outside the store."""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from store_helpers import forge, make_segment

from kvforge.store import DiskStore, codec
from kvforge.store.disk import shard
from kvforge.types import KVSegment


def _within(fn: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """``fn()`` in a thread; fails (instead of hanging the suite) if it has not returned within ``timeout_s``."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "hung"
    return out[0] if out else None


def _entry_path(store: DiskStore, key: str) -> Path:
    return store.root / "segments" / shard(key) / f"{key}.kvseg"


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def _kvtc_segment() -> KVSegment:
    return make_segment(lengths=(48, 48), num_heads=2, head_dim=8, masked=False)


# ------------------------------------------------------------------------------------------ not regular files
def test_a_fifo_at_an_entry_is_a_miss_never_a_hang(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(tmp_path / "kv", fsync=False)
    store.put("good", make_segment())
    fifo = _entry_path(store, "fifo")
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    blob_fifo = store.root / "blobs" / "index.blob"
    blob_fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(blob_fifo)
    with caplog.at_level(logging.WARNING):
        assert _within(lambda: store.get("fifo")) is None
        assert _within(lambda: store.get("fifo")) is None
        assert _within(lambda: store.get_blob("index")) is None
        assert _within(lambda: store.describe("fifo")) is None
        assert _within(lambda: store.keys()) == ["good"]  # listed, never opened
        assert _within(lambda: store.stats(deep=True))["entries"] == 1
        assert _within(lambda: store.clear()).removed == 1
    assert fifo.exists() and blob_fifo.exists()  # not ours: left alone
    assert sum("not a store entry" in r.getMessage() for r in caplog.records) == 1  # one warning per cause


def test_links_are_not_followed_out_of_the_store(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    victim = outside / "precious.kvseg"
    victim.write_bytes(codec.encode(make_segment()))
    store = DiskStore(tmp_path / "kv", fsync=False)
    store.put("good", make_segment())
    link = _entry_path(store, "linked")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    # a shard folder (hashed, and of the former layout) linked to a folder outside
    (store.root / "segments" / shard("other")).symlink_to(outside) if shard("other") != shard("good") else None
    (outside / "other.kvseg").write_bytes(codec.encode(make_segment()))
    (store.root / "segments" / "ot").symlink_to(outside)  # old layout: segments/<key[:2]>/
    (outside / "ot1.kvseg").write_bytes(codec.encode(make_segment()))
    store = DiskStore(tmp_path / "kv", fsync=False)  # rescans on open: moves old-layout files, never these
    assert store.get("linked") is None and store.get("other") is None and store.get("ot1") is None
    assert sorted(store.keys()) == ["good"]
    store.put("other", make_segment(seed=3))  # a write never lands in a linked folder
    assert store.clear().removed >= 1
    assert victim.exists() and (outside / "other.kvseg").exists() and (outside / "ot1.kvseg").exists()
    assert link.is_symlink()


# ------------------------------------------------------------------------------------------ declared sizes
def test_a_garbage_header_is_rejected_without_reading_the_file(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "kv", fsync=False)
    path = _entry_path(store, "sparse")
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage garbage")
        f.truncate(1 << 30)  # 1 GiB, sparse: nothing on disk, but a whole read would copy it
    before = _bytes_read()
    assert store.get("sparse") is None
    assert _bytes_read() - before < 8 << 20
    assert not path.exists()  # a corrupt entry of ours: removed


def test_a_file_over_max_bytes_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(tmp_path / "kv", max_bytes=1 << 20, fsync=False)
    path = _entry_path(store, "huge")
    path.parent.mkdir(parents=True)
    data = codec.encode(make_segment())
    path.write_bytes(data)
    os.truncate(path, 64 << 20)
    before = _bytes_read()
    with caplog.at_level(logging.WARNING):
        assert store.get("huge") is None
    assert _bytes_read() - before < 1 << 20
    assert "over its bound" in caplog.text


def test_forged_shapes_are_refused_before_allocation(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A small entry with valid checksums whose header declares huge shapes (a kvtc layer: its codes are inflated
    into what the header declares) is corrupt, found before the tensors are made."""
    data = codec.encode(_kvtc_segment(), "kvtc")

    def huge(h: dict) -> None:
        for info in h["layers"]:
            info["k_shape"][1] = info["v_shape"][1] = 10**9

    store = DiskStore(tmp_path / "kv", fsync=False)
    store.write("forged", forge(data, huge))
    with caplog.at_level(logging.WARNING):
        assert store.get("forged") is None
    assert "declares tensors of over" in caplog.text
    assert not store.contains("forged")  # removed


@pytest.mark.parametrize("name", ["m.1", "p.1"])
def test_a_deflate_bomb_is_not_inflated(name: str) -> None:
    """A mask or position stream that inflates past what its header declares is refused at the declared size."""
    seg = make_segment(lengths=(40, 40), num_heads=2, head_dim=8)  # layer 1: head-wise (packed, mask as bits)
    bomb = torch.frombuffer(bytearray(zlib.compress(bytes(64 << 20), 9)), dtype=torch.uint8)
    forged = forge(codec.encode(seg), tensors=lambda t: t.__setitem__(name, bomb))
    with pytest.raises(codec.CorruptSegmentError, match="does not inflate to the"):
        codec.decode(bytearray(forged))


def test_inflate_never_exceeds_the_declared_size() -> None:
    from kvforge.store.transform import inflate

    assert inflate(zlib.compress(b"abc"), 3, "x") == b"abc"
    for size in (0, 2, 4):  # 0: zlib's "no limit" must not be what an empty stream declares
        with pytest.raises(codec.CorruptSegmentError):
            inflate(zlib.compress(b"abc" if size else bytes(1 << 20)), size, "x")


def test_the_basis_name_is_never_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real = Path.read_bytes

    def spy(self: Path) -> bytes:
        opened.append(str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", spy)
    data = forge(codec.encode(_kvtc_segment(), "kvtc"), lambda h: h.__setitem__("basis", "../../../../etc/passwd"))
    with pytest.raises(codec.CorruptSegmentError, match="is not a digest"):
        codec.decode(bytearray(data))
    assert not any("passwd" in p for p in opened)


# ------------------------------------------------------------------------------------------ Redis values
@pytest.fixture
def fake_redis(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A RedisStore factory on fakeredis (with Lua: the store's writes are scripts) and the raw client."""
    fakeredis = pytest.importorskip("fakeredis")
    pytest.importorskip("lupa")
    from kvforge.store import redis as redis_store

    server = fakeredis.FakeServer()
    monkeypatch.setattr(redis_store, "client_from_url", lambda *a, **k: fakeredis.FakeRedis(server=server))
    raw = fakeredis.FakeRedis(server=server)
    return (lambda **kw: redis_store.RedisStore("redis://127.0.0.1:1/0", **kw)), raw


def test_forged_redis_metadata_is_a_miss_with_one_warning(fake_redis: Any, caplog: pytest.LogCaptureFixture) -> None:
    make, raw = fake_redis
    store = make()
    store.put("aa", make_segment())
    good = json.loads(raw.get("kvforge:seg:aa:meta"))
    forged = {
        "many": good | {"chunks": 3_000_000, "bytes": 3_000_000},  # chunks that do not exist: one round trip
        "text": good | {"chunks": "1"},
        "nonce": good | {"nonce": "../x"},
        "junk": "not json {",
    }
    for key, meta in forged.items():
        raw.set(f"kvforge:seg:{key}:meta", meta if isinstance(meta, str) else json.dumps(meta))
        raw.zadd("kvforge:seg:lru", {key: 1.0})
    with caplog.at_level(logging.WARNING):
        for key in forged:
            assert _within(lambda key=key: store.get(key)) is None
            assert store.get(key) is None  # removed: a plain miss now
    assert sum("malformed" in r.getMessage() for r in caplog.records) == len(forged) - 1  # "many": lost data
    assert store.get("aa") is not None and store.keys() == ["aa"]


def test_bad_names_and_sizes_in_redis_are_skipped(fake_redis: Any) -> None:
    make, raw = fake_redis
    store = make(max_bytes=10**9)
    store.put("aa", make_segment())
    store.put_blob("semantic-v1-rec-x", b"record")
    raw.hset("kvforge:blob:sizes", "../not a key", 5)
    raw.hset("kvforge:seg:sizes", "bb", "many")
    raw.zadd("kvforge:seg:lru", {"bad name!": 2.0})
    meta = json.loads(raw.get("kvforge:seg:aa:meta"))
    meta["summary"] |= {"num_tokens": "many", "full_bytes": [1]}  # what `cache stats` sums
    raw.set("kvforge:seg:aa:meta", json.dumps(meta))
    assert store.keys() == ["aa"] and store.blob_keys() == ["semantic-v1-rec-x"]
    store.client.info = lambda *a: {}  # not in fakeredis
    stats = store.stats(deep=True)
    assert stats["entries"] == 2 and stats["bytes"] == store.stored_size("aa")
    store.put("cc", make_segment(seed=1))  # an eviction pass reads the sizes hash too
    assert store.contains("cc")


# ------------------------------------------------------------------------------------------ semantic index input
def test_an_old_index_with_a_garbage_body_never_reaches_faiss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("faiss")
    from kvforge.reuse import FakeEmbedder, SemanticReuse
    from kvforge.reuse.index import MAGIC

    store = DiskStore(tmp_path / "kv", fsync=False)
    probe = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)
    header = json.dumps({"dim": FakeEmbedder().dim, "next_id": 1, "entries": {"0": {"key": "k0", "text": "t"}}})
    body = b"IxM2" + bytes(64)  # FAISS's tag, then garbage
    store.put_blob(probe.index_key, MAGIC + len(header).to_bytes(8, "little") + header.encode() + body)
    with caplog.at_level(logging.WARNING):
        semantic = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)  # starts
    assert len(semantic.index) == 0
    assert "FAISS body of 68 bytes" in caplog.text


def test_index_records_with_bad_names_are_skipped(tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    import numpy as np

    from kvforge.reuse import FakeEmbedder, SemanticReuse
    from kvforge.reuse.index import IndexEntry, read_record, record_bytes

    dim = FakeEmbedder().dim
    vector = np.ones(dim, dtype=np.float32) / np.sqrt(dim)
    with pytest.raises(ValueError, match="not a store key"):
        read_record(record_bytes(vector, IndexEntry("../../x", "text")), dim)
    store = DiskStore(tmp_path / "kv", fsync=False)
    probe = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)
    store.put_blob(probe.record_prefix + "bad", record_bytes(vector, IndexEntry("bad key/..", "text")))
    assert len(SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6).index) == 0


def test_foreign_statistics_blobs_are_skipped(tmp_path: Path) -> None:
    from kvforge.reuse.stats import FORMAT, SharedStats

    store = DiskStore(tmp_path / "kv", fsync=False)
    store.put_blob("st-other", json.dumps({"format": FORMAT, "writers": "x", "entries": []}).encode())
    store.put_blob("st-third", json.dumps({"format": FORMAT, "writers": {}, "entries": {"k": [[1, 2]]}}).encode())
    stats = SharedStats(store, "st-")
    assert stats.view(force=True).counts == {} and stats.compact() == 0


def test_a_children_list_naming_a_bad_chain_is_skipped() -> None:
    from kvforge.reuse import chain

    raw = json.dumps({"format": chain.FORMAT, "parent": "p", "children": [["../../x", [1]], ["abc", [2]]]}).encode()
    assert chain.decode_list("p", raw) == [("abc", [2])]


# ------------------------------------------------------------------------------------------ the byte budget
def _on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and "blobs" not in p.parts)


def test_writers_sharing_a_folder_stay_within_max_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Room is made before a write, counting every write in flight (another process's included): at the moment a
    write completes, the entries and the partial writes still fit ``max_bytes``."""
    from kvforge.store import disk

    size = len(codec.encode(make_segment()))
    store = DiskStore(tmp_path / "kv", max_bytes=3 * size, fsync=False, rescan_s=3600.0)
    for i in range(3):
        store.put(f"k{i}", make_segment(seed=i))
    (tmp_path / "kv" / "tmp" / "other.99.beef.tmp").write_bytes(bytes(size))  # another writer's write in flight
    peak: list[int] = []
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        peak.append(_on_disk(tmp_path / "kv"))  # the new entry written, nothing removed yet
        real_replace(src, dst)

    monkeypatch.setattr(disk.os, "replace", replace)
    store.put("new", make_segment(seed=9))
    assert peak and max(peak) <= 3 * size, (peak, 3 * size)
    assert store.contains("new") and _on_disk(tmp_path / "kv") <= 3 * size
