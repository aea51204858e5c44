"""Memory and disk stores, the tiered store over them, and open_store URL parsing."""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from store_helpers import full_disk_at_shard_folders, make_segment

from kvforge.errors import UserError
from kvforge.store import DiskStore, KVStore, MemoryStore, TieredStore, default_store_url, open_store
from kvforge.store.codec import encode, segments_equal
from kvforge.store.disk import shard


@pytest.fixture(params=["memory", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> MemoryStore | DiskStore:
    return MemoryStore() if request.param == "memory" else DiskStore(tmp_path / "kv")


def entry_size(seed: int = 0) -> int:
    return len(encode(make_segment(seed=seed)))


def test_protocol_operations(store: MemoryStore | DiskStore) -> None:
    assert isinstance(store, KVStore)
    seg = make_segment(torch.bfloat16)
    assert store.get("ab01") is None and not store.contains("ab01")
    store.put("ab01", seg)
    assert store.contains("ab01") and store.keys() == ["ab01"]
    assert segments_equal(store.get("ab01"), seg)
    store.put("ab01", make_segment(seed=1))  # replace
    assert segments_equal(store.get("ab01"), make_segment(seed=1)) and len(store.keys()) == 1
    stats = store.stats()
    assert stats["entries"] == 1 and stats["bytes"] == entry_size(1) and stats["hits"] == 2 and stats["misses"] == 1
    store.put_blob("semantic.index", b"\x00faiss bytes")
    assert store.get_blob("semantic.index") == b"\x00faiss bytes" and store.get_blob("nope") is None
    assert store.stats(deep=True)["by_press"] == {"snapkv": 1}
    store.delete("ab01")
    assert store.get("ab01") is None and store.keys() == []
    store.put("cd02", seg)
    store.clear()
    assert store.keys() == [] and store.get_blob("semantic.index") is None


def test_invalid_keys_are_refused(store: MemoryStore | DiskStore) -> None:
    for key in ("../etc/passwd", "a/b", "", "a:b", "x" * 201):
        with pytest.raises(ValueError, match="invalid store key"):
            store.put(key, make_segment())


def test_lru_eviction_by_bytes(tmp_path: Path, store: MemoryStore | DiskStore) -> None:
    size = entry_size()
    bound = int(size * 3.5)
    lru = MemoryStore(max_bytes=bound) if isinstance(store, MemoryStore) else DiskStore(tmp_path / "lru", bound)
    for key in ("aa", "bb", "cc"):
        lru.put(key, make_segment())
    assert lru.get("aa") is not None  # aa is now the most recently used; bb the least
    lru.put("dd", make_segment())
    assert lru.stats()["bytes"] <= bound
    lru.put("ee", make_segment())
    assert sorted(lru.keys()) == ["aa", "dd", "ee"] and lru.stats()["evictions"] == 2
    assert lru.stats()["bytes"] == 3 * size <= bound


def test_entry_larger_than_capacity_is_not_stored(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    for small in (MemoryStore(max_bytes=100), DiskStore(tmp_path, max_bytes=100)):
        small.put("aa", make_segment())
        assert small.keys() == [] and "exceeds max_bytes" in caplog.text


def test_memory_store_is_isolated_from_callers() -> None:
    store = MemoryStore()
    seg = make_segment()
    store.put("aa", seg)
    seg.keys[0].zero_()
    got = store.get("aa")
    got.values[0].zero_()
    assert segments_equal(store.get("aa"), make_segment())


def test_disk_restart_keeps_entries_and_lru_order(tmp_path: Path) -> None:
    size = entry_size()
    store = DiskStore(tmp_path, max_bytes=int(size * 3.5))
    for key in ("aa", "bb", "cc"):
        store.put(key, make_segment())
    store.get("aa")
    store.put_blob("index", b"blob")
    reopened = DiskStore(tmp_path, max_bytes=int(size * 3.5))  # a new process: index rebuilt from the files
    assert reopened.keys() == ["bb", "cc", "aa"] and reopened.stats()["bytes"] == 3 * size
    assert segments_equal(reopened.get("cc"), make_segment()) and reopened.get_blob("index") == b"blob"
    reopened.put("dd", make_segment())
    assert sorted(reopened.keys()) == ["aa", "cc", "dd"]


def test_disk_corrupt_or_truncated_file_is_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(tmp_path)
    for key in ("aa", "bb", "cc"):
        store.put(key, make_segment())
    path = store.path("aa")
    path.write_bytes(path.read_bytes()[:-7])  # truncated
    raw = bytearray(store.path("bb").read_bytes())
    raw[-3] ^= 1  # one flipped bit
    store.path("bb").write_bytes(bytes(raw))
    store.path("cc").write_bytes(b"")  # empty
    with caplog.at_level(logging.WARNING):
        assert store.get("aa") is None and store.get("bb") is None and store.get("cc") is None
    assert caplog.text.count("corrupt") == 3
    assert not path.exists() and store.keys() == [] and store.stats()["corrupt"] == 3
    store.put("aa", make_segment())  # the key is usable again
    assert segments_equal(store.get("aa"), make_segment())


def test_disk_corrupt_blob_is_missing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(tmp_path)
    store.put_blob("index", b"0123456789")
    store.path("index", "blob").write_bytes(store.path("index", "blob").read_bytes()[:-1])
    assert store.get_blob("index") is None and "blob index is corrupt" in caplog.text


def test_disk_leftover_tmp_file_is_never_read(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    good = encode(make_segment())
    (tmp_path / "tmp").mkdir()  # made by a writer (opening a store creates no folder)
    fresh = tmp_path / "tmp" / "aa.123.beef.tmp"
    fresh.write_bytes(good)  # a complete-looking write that was never renamed into place
    stale = tmp_path / "tmp" / "bb.123.dead.tmp"
    stale.write_bytes(good[:100])
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert store.get("aa") is None and store.keys() == [] and not store.contains("aa")
    reopened = DiskStore(tmp_path)
    assert not stale.exists() and fresh.exists()  # crashed writes are cleaned up, a recent one may be in flight
    assert reopened.keys() == []


def test_disk_failed_write_keeps_the_old_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskStore(tmp_path)
    store.put("aa", make_segment(seed=1))

    def crash(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):  # the backend raises ...
        store.write("aa", b"new bytes")
    store.put("aa", make_segment(seed=2))  # ... and the store's one rule makes it a skipped write
    monkeypatch.undo()
    assert segments_equal(store.get("aa"), make_segment(seed=1))
    assert list((tmp_path / "tmp").iterdir()) == []


def test_disk_full_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    store = DiskStore(tmp_path)
    store.put("aa", make_segment(seed=1))

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    store.put("aa", make_segment(seed=2))
    monkeypatch.undo()
    assert "No space left on device [ENOSPC]" in caplog.text and segments_equal(store.get("aa"), make_segment(seed=1))
    assert list((tmp_path / "tmp").iterdir()) == []


def test_disk_store_in_an_unusable_place(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UserError, match=r"cannot use .* as a disk store"):
        DiskStore(tmp_path / "file" / "kv")


def test_disk_ignores_foreign_files(tmp_path: Path) -> None:
    (tmp_path / "segments" / "ab").mkdir(parents=True)
    (tmp_path / "README.txt").write_text("mine")
    (tmp_path / "segments" / "ab" / "notes.txt").write_text("mine")
    wrong = next(f"{i:02x}" for i in range(256) if f"{i:02x}" not in (shard("ab12"), "ab"))
    (tmp_path / "segments" / wrong).mkdir()
    (tmp_path / "segments" / wrong / "ab12.kvseg").write_text("wrong folder")
    store = DiskStore(tmp_path)
    store.put("ab12", make_segment())
    assert store.keys() == ["ab12"] and store.stats()["bytes"] == entry_size()
    store.clear()
    assert (tmp_path / "README.txt").exists() and (tmp_path / "segments" / "ab" / "notes.txt").exists()


def test_disk_spreads_keys_sharing_a_start_over_folders(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, fsync=False)
    seg = make_segment(lengths=(1,))
    keys = [f"prefix-v1-{i:04d}" for i in range(64)]
    for key in keys:
        store.put(key, seg)
    folders = {p.parent.name for p in (tmp_path / "segments").glob("*/*.kvseg")}
    assert len(folders) > 32  # 64 keys in 256 hashed folders (one folder with the former key[:2] layout)
    assert sorted(store.keys()) == keys and all(store.path(k).parent.name == shard(k) for k in keys)


def _to_old_layout(root: Path, keys: list[str]) -> None:
    """Move segment files where kvforge put them before the hashed layout: segments/<key[:2]>/ (mtimes kept)."""
    for key in keys:
        new = root / "segments" / shard(key) / f"{key}.kvseg"
        old = root / "segments" / key[:2] / f"{key}.kvseg"
        old.parent.mkdir(exist_ok=True)
        st = new.stat()
        os.replace(new, old)
        os.utime(old, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_disk_old_layout_is_migrated_on_open_with_its_lru_order(tmp_path: Path) -> None:
    keys = ["prefix-v1-a", "prefix-v1-b", "prefix-v1-c"]
    store = DiskStore(tmp_path)
    for i, key in enumerate(keys):
        store.put(key, make_segment(seed=i))
    store.get(keys[0])  # LRU order now b, c, a
    _to_old_layout(tmp_path, keys)
    assert not list((tmp_path / "segments").glob(f"{shard(keys[0])}/*.kvseg"))
    reopened = DiskStore(tmp_path)
    assert reopened.keys() == [keys[1], keys[2], keys[0]]
    assert not (tmp_path / "segments" / "pr").exists() or not list((tmp_path / "segments" / "pr").iterdir())
    for i, key in enumerate(keys):
        assert (tmp_path / "segments" / shard(key) / f"{key}.kvseg").is_file()
        assert segments_equal(reopened.get(key), make_segment(seed=i))
    _to_old_layout(tmp_path, keys[:1])  # a straggler written by an older kvforge while this one runs
    assert sorted(reopened.keys()) == sorted(keys) and reopened.path(keys[0]).parent.name == shard(keys[0])


def test_disk_old_layout_is_read_in_place_by_a_read_only_store(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.put("prefix-v1-a", make_segment())
    _to_old_layout(tmp_path, ["prefix-v1-a"])
    ro = DiskStore(tmp_path, read_only=True)
    assert ro.keys() == ["prefix-v1-a"] and ro.contains("prefix-v1-a")
    assert segments_equal(ro.get("prefix-v1-a"), make_segment()) and ro.describe("prefix-v1-a")["num_tokens"] == 7
    assert (tmp_path / "segments" / "pr" / "prefix-v1-a.kvseg").is_file()  # not moved: the store is read-only


def test_disk_store_validates_the_key_in_every_method(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    calls = [
        lambda k: store.path(k), lambda k: store.read(k), lambda k: store.read(k, "blob"),
        lambda k: store.write(k, b"x"), lambda k: store.write_parts(k, [b"x"], "blob"), lambda k: store.remove(k),
        lambda k: store.has(k), lambda k: store.read_header(k), lambda k: store.stored_size(k),
        lambda k: store.touch(k), lambda k: store.describe(k), lambda k: store.get(k), lambda k: store.contains(k),
        lambda k: store.delete(k), lambda k: store.put(k, make_segment()), lambda k: store.get_blob(k),
        lambda k: store.put_blob(k, b"x"), lambda k: store.delete_blob(k),
    ]  # fmt: skip
    for key in ("../escape", "a/b", "", ".hidden"):
        for call in calls:
            with pytest.raises(ValueError, match="invalid store key"):
                call(key)
    assert not list(tmp_path.rglob("*escape*")) and not (tmp_path / "tmp").exists()


def test_disk_full_while_creating_a_shard_folder_is_a_skipped_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = DiskStore(tmp_path)
    with caplog.at_level(logging.WARNING), full_disk_at_shard_folders():
        for i in range(3):
            store.put(f"key{i}", make_segment(seed=i))  # no exception: a cache that cannot grow skips the write
    assert store.keys() == [] and list((tmp_path / "tmp").iterdir()) == []
    assert len([r for r in caplog.records if "No space left" in r.getMessage()]) == 1
    with caplog.at_level(logging.WARNING):
        store.put("key0", make_segment())
    assert segments_equal(store.get("key0"), make_segment()) and "writes succeed again" in caplog.text


def test_disk_two_instances_share_a_folder(tmp_path: Path) -> None:
    size = entry_size()
    a, b = (DiskStore(tmp_path, max_bytes=int(size * 2.5), rescan_s=0.0) for _ in range(2))
    a.put("aa", make_segment())
    assert segments_equal(b.get("aa"), make_segment())
    b.put("bb", make_segment())
    a.put("cc", make_segment())  # a never saw bb written, yet the folder stays within the bound
    assert sorted(a.keys()) == ["bb", "cc"] and a.stats()["bytes"] <= int(size * 2.5)


def test_quantised_store_reports_stored_vs_full(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, quant="int8-kivi")
    seg = make_segment(lengths=(64, 64), head_dim=32, masked=False)
    store.put("aa", seg)
    out = store.get("aa")
    assert out.meta["quant"] == "int8-kivi" and out.keys[0].dtype == torch.float32
    deep = store.stats(deep=True)
    assert deep["full_bytes"] == seg.nbytes() and deep["stored_ratio"] < 0.35 and deep["by_quant"] == {"int8-kivi": 1}


def test_tiered_promotes_on_hit(tmp_path: Path) -> None:
    mem, disk = MemoryStore(), DiskStore(tmp_path)
    tiered = TieredStore([mem, disk])
    assert isinstance(tiered, KVStore)
    tiered.put("aa", make_segment())
    assert mem.contains("aa") and disk.contains("aa")
    mem.clear()
    assert segments_equal(tiered.get("aa"), make_segment())
    assert mem.contains("aa") and tiered.tier_hits == [0, 1]
    assert segments_equal(tiered.get("aa"), make_segment()) and tiered.tier_hits == [1, 1]
    stats = tiered.stats()
    assert stats["hits"] == 2 and [t["backend"] for t in stats["tiers"]] == ["memory", "file"]
    tiered.put_blob("idx", b"x")
    mem.clear()
    assert tiered.get_blob("idx") == b"x" and mem.get_blob("idx") == b"x"
    tiered.delete("aa")
    assert not tiered.contains("aa") and tiered.get("aa") is None and tiered.misses == 1


def test_tiered_skips_a_corrupt_copy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, second = DiskStore(tmp_path / "a"), DiskStore(tmp_path / "b")
    tiered = TieredStore([first, second])
    tiered.put("aa", make_segment())
    first.path("aa").write_bytes(first.path("aa").read_bytes()[:50])
    assert segments_equal(tiered.get("aa"), make_segment()) and "corrupt" in caplog.text
    tiered.flush()  # disk-to-disk promotion runs in the background
    assert segments_equal(first.get("aa"), make_segment())  # repaired by the promotion


def test_tiered_quantises_per_tier(tmp_path: Path) -> None:
    exact, small = MemoryStore(), DiskStore(tmp_path, quant="int8-channel")
    TieredStore([exact, small]).put("aa", make_segment())
    assert "quant" not in exact.get("aa").meta and small.get("aa").meta["quant"] == "int8-channel"


def test_default_disk_store_lives_in_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    assert default_store_url() == f"file://{tmp_path}/kv"
    store = open_store("file://")
    assert isinstance(store, DiskStore) and store.root == tmp_path / "kv"


def test_open_store_urls(tmp_path: Path) -> None:
    mem = open_store("memory://?max_bytes=2KiB&quant=int8-token")
    assert isinstance(mem, MemoryStore) and mem.max_bytes == 2048 and mem.quant == "int8-token"
    disk = open_store(f"file://{tmp_path}/kv?max_bytes=1.5GB&fsync=0")
    assert isinstance(disk, DiskStore) and disk.root == tmp_path / "kv" and disk.max_bytes == 1_500_000_000
    assert not disk.fsync
    tiered = open_store(f"memory://, file://{tmp_path}/kv")
    assert isinstance(tiered, TieredStore) and [t.scheme for t in tiered.tiers] == ["memory", "file"]
    with pytest.raises(UserError, match=r"supported are memory://, file://, redis://"):
        open_store("s3://bucket/x")
    with pytest.raises(UserError, match="supported are"):
        open_store(str(tmp_path))
    with pytest.raises(UserError, match="unknown option"):
        open_store("memory://?max_byte=1")
    with pytest.raises(UserError, match="invalid size"):
        open_store("memory://?max_bytes=lots")
    with pytest.raises(UserError, match="quantisation"):
        open_store("memory://?quant=int3")


def test_concurrent_writers_and_readers_never_see_a_mix(tmp_path: Path) -> None:
    import threading

    versions = [make_segment(seed=s) for s in range(3)]
    store = TieredStore([MemoryStore(max_bytes=3 * entry_size()), DiskStore(tmp_path, max_bytes=8 * entry_size())])
    errors: list[str] = []

    def work(worker: int) -> None:
        for i in range(15):
            key = f"k{i % 4}"
            if (i + worker) % 2:
                store.put(key, versions[(i + worker) % 3])
            else:
                got = store.get(key)
                if got is not None and not any(segments_equal(got, v) for v in versions):
                    errors.append(f"{key}: a segment that was never written")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    assert errors == [] and list((tmp_path / "tmp").iterdir()) == []


def test_disk_read_hashes_while_reading_and_decode_uses_it_only_at_the_payload_offset(tmp_path: Path) -> None:
    from kvforge.errors import CorruptSegmentError
    from kvforge.store import codec

    store = DiskStore(tmp_path)
    store.put("aa", make_segment())
    data = store.read("aa")
    start, digest = data.payload_checksum
    assert start == codec.header_size(bytes(data[:16])) and len(digest) == 32
    assert segments_equal(codec.decode(data, payload_checksum=(start, digest)), make_segment())
    assert segments_equal(codec.decode(data, payload_checksum=(start - 8, "0" * 32)), make_segment())  # not trusted
    with pytest.raises(CorruptSegmentError, match="checksum mismatch"):
        codec.decode(data, payload_checksum=(start, "0" * 32))
