"""Store cases: each fault provoked for real on the stores, in this process or in child processes."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from store_helpers import free_port, make_segment, redis_chunk_audit, redis_server

from fault_cases import ROOT, Case, ends, equals, starts, warnings_logged
from kvforge.cli import main as cli
from kvforge.errors import UserError
from kvforge.store import open_store
from kvforge.store.codec import encode, segments_equal

SECRET = "s3cr3t-Pa55"


def password_in_cli(tmp: Path) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli(["cache", "stats", "--store", f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"])
    text = out.getvalue() + err.getvalue()
    return f"{rc}/{err.getvalue().count(chr(10))}/{'yes' if SECRET in text else 'no'}"


def odd_urls(tmp: Path) -> str:
    n = 0
    for url in ("memory://?max_bytes=1e400", "redis://h:1/abc", "file://rel/x", "redis://h:1/0?timeout=nan",
                "redis://h:1/0?socket_timout=1"):  # fmt: skip
        try:
            open_store(url)
        except UserError as e:
            n += "\n" not in str(e)
    return str(n)


def header_flips(tmp: Path) -> str:
    from kvforge.errors import CorruptSegmentError, ModelMismatchError
    from kvforge.store import codec

    data = encode(make_segment(), checksum_algo="sha256")
    n = codec.header_size(data)  # format 3: the length field + the safetensors JSON (index + kvforge header)
    accepted = 0
    for i in range(n):
        flipped = bytearray(data)
        flipped[i] ^= 1
        try:
            codec.decode(flipped)
            accepted += 1
        except (CorruptSegmentError, ModelMismatchError):
            pass
    return f"{accepted} of {n} accepted"


def truncated(tmp: Path) -> str:
    store = open_store(f"file://{tmp}/trunc")
    store.put("aa", make_segment())
    path = store.path("aa")  # type: ignore[attr-defined]
    path.write_bytes(path.read_bytes()[:-100])
    return f"{store.get('aa')}/{store.contains('aa')}"


def read_only(tmp: Path) -> str:
    open_store(f"file://{tmp}/ro").put("aa", make_segment())
    store = open_store(f"file://{tmp}/ro?read_only=1")
    hit = "hit" if segments_equal(store.get("aa"), make_segment()) else "miss"
    store.put("bb", make_segment(seed=1))
    put = "skipped" if not store.contains("bb") else "written"
    result = store.clear()
    return f"{hit}/{put}/{result.removed} removed, {len(result.failed)} failed"


def _two_writers(url: str, tmp: Path) -> str:
    """The concurrency test's two writer processes (25 prompts each), then who is indexed and found."""
    from test_semantic_index_concurrency import WRITER, _texts

    from kvforge.reuse import FakeEmbedder, SemanticReuse

    script = tmp / "writer.py"
    script.write_text(WRITER)
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    procs = [subprocess.Popen([sys.executable, str(script), url, w], env=env) for w in "AB"]
    if [p.wait(timeout=600) for p in procs] != [0, 0]:
        return "writer failed"
    reuse = SemanticReuse(open_store(url), "tiny", FakeEmbedder(), threshold=0.6)
    found = sum(not isinstance(reuse.lookup(text), str) for text in _texts())
    return f"{len(reuse.index)} indexed, {found} found"


def semantic_file(tmp: Path) -> str:
    return _two_writers(f"file://{tmp}/sem", tmp)


def _redis_pid(url: str) -> int:
    port = url.split(":")[2].split("/")[0]
    out = subprocess.run(["pgrep", "-f", f"redis-server 127.0.0.1:{port}"], capture_output=True, text=True).stdout
    return int(out.split()[0])


def semantic_redis(tmp: Path) -> str:
    with redis_server(tmp) as url:
        return _two_writers(url, tmp)


def hung_redis(tmp: Path) -> str:
    with redis_server(tmp) as url:
        store = open_store(url + "?timeout=0.5&connect_timeout=0.5")
        store.put("aa", make_segment())
        pid = _redis_pid(url)
        # (warnings_logged sets the level with setLevel: assigning Logger.level leaves the loggers' cached
        # isEnabledFor answers, so after an earlier case's warning under the run's ERROR level none was seen)
        with warnings_logged() as records:
            os.kill(pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                got = [store.get("aa"), store.put("bb", make_segment()), store.get("bb")]
                elapsed = time.monotonic() - start
            finally:
                os.kill(pid, signal.SIGCONT)
        misses = "misses" if got[0] is None and got[2] is None else "hits?"
        warned = sum("unavailable" in message for message in records)
        return f"{misses}/{elapsed:.1f}s/{'<3s' if elapsed < 3 else '>=3s'}/{warned}"


def redis_sigkill(tmp: Path) -> str:
    import random

    from test_store_redis import WRITER

    from kvforge.store.redis import RedisStore

    rng = random.Random(0)
    with redis_server(tmp) as url:
        script = tmp / "writer.py"
        script.write_text(WRITER)
        env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
        partial = orphans = mid_data = 0
        for _ in range(3):
            tests = str(ROOT / "tests")
            proc = subprocess.Popen(
                [sys.executable, str(script), url, tests], stdout=subprocess.PIPE, text=True, env=env
            )
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.1, 1.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            live, data, ttls = redis_chunk_audit(url, "sk")
            orphans += sum(ttls[k] < 0 for k in data - live)
            mid_data += bool(data - live)
            store = RedisStore(url, prefix="sk")
            partial += sum(store.get(k) is None for k in store.list_keys("seg")) + len(live - data)
        return f"{'whole' if not partial else f'{partial} partial'}/{'ttl' if not orphans else f'{orphans} orphans'}" \
               f" (killed mid-data {mid_data} of 3)"  # fmt: skip


def disk_layout_migration(tmp: Path) -> str:
    from test_store_backends import _to_old_layout

    from kvforge.store.disk import DiskStore, shard

    keys = ["prefix-v1-a", "prefix-v1-b", "prefix-v1-c"]
    store = DiskStore(tmp / "old")
    for i, key in enumerate(keys):
        store.put(key, make_segment(seed=i))
    store.get(keys[0])
    order = store.keys()
    _to_old_layout(tmp / "old", keys)  # where kvforge put them before the hashed layout
    reopened = DiskStore(tmp / "old")
    moved = all((tmp / "old" / "segments" / shard(k) / f"{k}.kvseg").is_file() for k in keys)
    kept = reopened.keys() == order
    hits = sum(segments_equal(reopened.get(k), make_segment(seed=i)) for i, k in enumerate(keys))
    return f"{'moved' if moved else 'not moved'}/{hits} hits/{'order kept' if kept else 'order lost'}"


def full_disk_shard(tmp: Path) -> str:
    from store_helpers import full_disk_at_shard_folders

    from kvforge.store.disk import DiskStore

    store = DiskStore(tmp / "full")
    try:
        with warnings_logged() as records, full_disk_at_shard_folders():
            for i in range(3):
                store.put(f"key{i}", make_segment(seed=i))
        outcome = "ok"
    except Exception as e:
        outcome = type(e).__name__
    return f"{outcome}/{'skipped' if not store.keys() else 'written'}/{sum('No space left' in m for m in records)}"


def semantic_rebuild(tmp: Path) -> str:
    from kvforge.cache import KVCache
    from kvforge.prefill import prefill
    from kvforge.reuse import FakeEmbedder, SemanticReuse
    from kvforge.testing import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    store = open_store(f"file://{tmp}/sem")
    reuse = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)
    texts = [f"question {i} about subject {i * 3}" for i in range(8)]
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        cache = KVCache.for_model(model)
        prefill(model, ids, cache)
        reuse.record(ids, cache, text=text)
    records = sorted(store.blob_keys())
    for key in records[:2]:
        store.delete_blob(key)
    for key in records[2:4]:
        path = tmp / "sem" / "blobs" / f"{key}.blob"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x20
        path.write_bytes(bytes(data))
    reopened = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)
    found = sum(not isinstance(reopened.lookup(t), str) for t in texts)
    return f"{found} of {len(texts)} found"


# ------------------------------------------------------------------------------------------------ the kernel refuses
def _child(argv: list[str], **kwargs: object) -> tuple[dict, str]:
    import json

    from os_faults import python_env

    proc = subprocess.run(argv, capture_output=True, text=True, env=python_env(), timeout=300, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0 or "Traceback" in proc.stderr:
        raise RuntimeError(f"child failed (rc {proc.returncode}): {proc.stderr[-300:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def store_under(fault: str) -> Callable[[Path], str]:
    """A case: a disk store holding "aa", used by a child process under an OS fault (``os_faults.read_only``,
    ``full_disk``, or ``file_size_limit``: ulimit -f 4 KiB, and a small write): hit / 3 puts / delete / clear."""

    def run(tmp: Path) -> str:
        import os_faults
        from test_store_os_faults import CHILD

        from kvforge.store import DiskStore

        folder = tmp / "kv"
        DiskStore(folder, fsync=False).put("aa", make_segment())
        argv = [sys.executable, "-c", CHILD, f"file://{folder}?fsync=0"]
        if fault == "file_size_limit":
            out, err = _child([*argv, "small"], preexec_fn=os_faults.file_size_limit(4096))
        else:
            out, err = _child(getattr(os_faults, fault)(folder, argv))
        warned = sum(line.startswith("WARNING") and "write of" in line for line in err.splitlines())
        small = "" if out["small_stored"] is None else f"/small write {'kept' if out['small_stored'] else 'lost'}"
        return (f"{'hit' if out['hit'] else 'miss'}/{sum(out['new_stored'])} of 3 stored/{warned} write warning"
                f"/clear failed: {','.join(out['not_cleared']) or 'none'}{small}")  # fmt: skip

    return run


def cache_clear_read_only(tmp: Path) -> str:
    from os_faults import python_env, read_only

    from kvforge.store import DiskStore

    folder = tmp / "kv"
    store = DiskStore(folder, fsync=False)
    for i in range(4):
        store.put(f"k{i}", make_segment(seed=i))
    argv = read_only(folder, [sys.executable, "-m", "kvforge.cli", "cache", "clear", "--store", f"file://{folder}"])
    proc = subprocess.run(argv, capture_output=True, text=True, env=python_env(), timeout=120)
    said = "could not delete 4 entries" if "could not delete 4 entries" in proc.stderr else proc.stderr.strip()[-80:]
    return f"rc {proc.returncode}/{said}/{len(DiskStore(folder).keys())} kept"


def missing_folder(tmp: Path) -> str:
    rcs = []
    for command in (["ls"], ["ls", "--json"], ["stats"], ["clear"]):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rcs.append(cli(["cache", *command, "--store", f"file://{tmp}/no/such/store"]))
    return f"{','.join(map(str, rcs))}/{'created' if (tmp / 'no').exists() else 'not created'}"


def memory_bound(tmp: Path) -> str:
    from kvforge.store import MemoryStore

    size = len(encode(make_segment()))
    store = MemoryStore(max_bytes=3 * size)
    for i in range(20):
        store.put(f"k{i}", make_segment(seed=i))
    ok = store.stats()["bytes"] <= 3 * size
    return f"{'ok' if ok else 'over'}/{sum(store.contains(f'k{i}') for i in range(17, 20))}"


def disk_sigkill(tmp: Path) -> str:
    import random

    from os_faults import python_env

    from kvforge.store import DiskStore

    writer = (
        "import sys\nfrom store_helpers import make_segment\nfrom kvforge.store import DiskStore\n"
        "s = DiskStore(sys.argv[1], fsync=False)\nprint('ready', flush=True)\ni = 0\n"
        "while True:\n    s.put(f'k{i % 7}', make_segment(seed=i, lengths=(600, 300), num_heads=4, head_dim=64))\n"
        "    i += 1\n"
    )
    rng, bad, visible = random.Random(0), 0, 0
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", writer, str(tmp / "kv")], stdout=subprocess.PIPE, text=True,
                                env=python_env())  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.2, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        store = DiskStore(tmp / "kv")
        keys = store.keys()
        visible += len(keys)
        bad += sum(store.get(k) is None for k in keys)
    return f"{'whole' if not bad else f'{bad} partial'} ({visible} entries seen after 3 kills)"


def _prefix_setup(tmp: Path, model_id: str = "model-a", seed: int = 0):  # type: ignore[no-untyped-def]
    from kvforge.cache import KVCache
    from kvforge.prefill import prefill
    from kvforge.reuse import PrefixReuse
    from kvforge.store import DiskStore
    from kvforge.testing import tiny_model

    model = tiny_model("llama", seed=seed)
    store = DiskStore(tmp / "kv", fsync=False)
    reuse = PrefixReuse(store, model_id, block_size=16)

    def record(ids: list[int]) -> None:
        cache = KVCache.for_model(model)
        prefill(model, ids, cache)
        reuse.record(ids, cache)

    return store, reuse, record


def _copy_entry(store: object, src: str, dst: str) -> None:
    import shutil

    target = store.path(dst)  # type: ignore[attr-defined]
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(store.path(src), target)  # type: ignore[attr-defined]


def other_models_file(tmp: Path) -> str:
    from kvforge.reuse import PrefixReuse

    store, reuse_a, record = _prefix_setup(tmp)
    ids = [3 + (i * 7) % 90 for i in range(40)]
    record(ids)
    reuse_b = PrefixReuse(store, "model-b", block_size=16)
    for ka, kb in zip(reuse_a.block_keys(ids), reuse_b.block_keys(ids), strict=True):
        _copy_entry(store, ka, kb)
    return f"{reuse_b.plan(ids).reused_tokens} reused"


def copied_prefix_block(tmp: Path) -> str:
    store, reuse, record = _prefix_setup(tmp)
    a = [3 + (i * 5) % 90 for i in range(16)]
    b = [3 + (i * 11) % 90 for i in range(16)]
    c = [3 + (i * 13) % 90 for i in range(16)]
    t = [3 + (i * 17) % 90 for i in range(8)]
    x, y = a + c + t, b + c + t
    record(x)
    record(y)
    _copy_entry(store, reuse.block_keys(y)[1], reuse.block_keys(x)[1])
    return f"{reuse.plan(x).reused_tokens} reused"


def full_disk_prefix_head(tmp: Path) -> str:
    from os_faults import full_disk

    child = (
        "import json, sys\nfrom pathlib import Path\nsys.argv.append('x')\n"
        "from fault_cases.store import _prefix_setup\n"
        "store, reuse, record = _prefix_setup(Path(sys.argv[1]).parent)\n"
        "ids = [3 + (i * 7) % 90 for i in range(96)]\nrecord(ids)\n"
        "print(json.dumps({'reused': reuse.plan(ids).reused_tokens, 'stored': len(store.keys())}))\n"
    )
    folder = tmp / "kv"
    folder.mkdir()
    argv = full_disk(folder, [sys.executable, "-c", child, str(folder)], size="48k", fill=False)
    out, _ = _child(argv, cwd=str(ROOT / "benchmarks"))
    return f"{out['reused']} reused ({out['stored']} of 6 blocks stored)"


CASES = [
    Case("password in a store URL, Redis down, `kvforge cache stats`", "exit 2, one line, no password", password_in_cli,
         equals("2/1/no")),
    Case("odd store URLs (1e400, /abc, file://rel, ?timeout=nan, unknown option)", "5 one-line UserErrors", odd_urls,
         equals("5")),
    Case("segment with one flipped header byte (every byte tried)", "0 accepted", header_flips, starts("0 ")),
    Case("truncated segment file on disk", "miss (None), entry removed", truncated, equals("None/False")),
    Case("read-only folder (?read_only=1): get / put / clear", "hit / skipped / clear reports 1 not deleted", read_only,
         equals("hit/skipped/0 removed, 1 failed")),
    Case("two processes x 25 semantic records, one file:// store", "50 indexed, 50 found", semantic_file,
         equals("50 indexed, 50 found")),
    Case("two processes x 25 semantic records, one Redis", "50 indexed, 50 found", semantic_redis,
         equals("50 indexed, 50 found"), needs="redis-server"),
    Case("Redis SIGSTOP'd (hung), timeout=0.5: get + put + get", "misses, < 3 s, one warning", hung_redis, ends("/1"),
         needs="redis-server"),
    Case("Redis writer process SIGKILLed at random moments (3 times, real redis-server)",
         "every visible entry whole; every unreferenced chunk has a TTL", redis_sigkill, starts("whole/ttl"),
         needs="redis-server"),
    Case("disk store in the pre-hash layout (segments/<key[:2]>/), reopened",
         "moved to hashed folders, every entry a hit, LRU order kept", disk_layout_migration,
         equals("moved/3 hits/order kept")),
    Case("full disk while creating a shard folder (ENOSPC at mkdir), 3 writes",
         "no exception, writes skipped, one warning", full_disk_shard, equals("ok/skipped/1")),
    Case("semantic index: 2 of 8 records deleted, 2 with a flipped byte, then reopened",
         "8 of 8 found (rebuilt from the segments' headers)", semantic_rebuild, equals("8 of 8 found")),
    Case("disk store on a read-only bind mount (child process): hit, 3 new entries, delete, clear",
         "hit / 0 stored / 1 warning / clear says EROFS", store_under("read_only"),
         equals("hit/0 of 3 stored/1 write warning/clear failed: Read-only file system [EROFS]"), needs="namespaces"),
    Case("disk store on a full tmpfs (child process): hit, 3 new entries, delete, clear",
         "hit / 0 stored / 1 warning / deletes work", store_under("full_disk"),
         equals("hit/0 of 3 stored/1 write warning/clear failed: none"), needs="namespaces"),
    Case("disk store under ulimit -f 4 KiB (EFBIG; child process)",
         "hit / 0 stored / 1 warning / a small entry is kept", store_under("file_size_limit"),
         equals("hit/0 of 3 stored/1 write warning/clear failed: none/small write kept")),
    Case("`kvforge cache clear` on a read-only mount holding 4 entries",
         "rc 1, says it could not delete 4 (EROFS), 4 still there", cache_clear_read_only,
         equals("rc 1/could not delete 4 entries/4 kept"), needs="namespaces"),
    Case("`kvforge cache ls / ls --json / stats / clear` on a folder that does not exist",
         "rc 0 each, no folder created", missing_folder, equals("0,0,0,0/not created")),
    Case("memory store bounded at 3 entries' bytes, 20 puts", "bytes <= max_bytes, 3 newest kept", memory_bound,
         equals("ok/3")),
    Case("disk writer process SIGKILLed at random moments (3 times)",
         "every visible entry decodes; partial writes only in tmp/", disk_sigkill, starts("whole")),
    Case("another model's prefix block files copied under this model's keys", "a miss (0 tokens reused)",
         other_models_file, equals("0 reused")),
    Case("prefix block copied from another prompt: X = A+C+T, Y = B+C+T (16-token blocks), Y's 2nd block over X's",
         "X reuses its 1st block only (16 tokens), never Y's KV", copied_prefix_block, equals("16 reused")),
    Case("disk that fills while a 6-block prompt is stored (48 KiB tmpfs, child process)",
         "the same prompt then reuses the blocks that fit, from its first one", full_disk_prefix_head,
         lambda o: o.split()[0].isdigit() and int(o.split()[0]) >= 16, needs="namespaces"),
]
