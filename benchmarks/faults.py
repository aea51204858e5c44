"""Fault matrix of the stores: each case is provoked for real and what happened is compared with what must happen.

    python benchmarks/faults.py [--out benchmarks/results/faults.jsonl]

Prints one JSON line per case (case, expected, observed, ok) and a table; exits 1 if a case fails. Needs
redis-server on PATH for the Redis cases (skipped otherwise). Everything runs on 127.0.0.1, bounded in time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from store_helpers import free_port, make_segment, redis_chunk_audit, redis_server

from kvforge.cli import main as cli
from kvforge.errors import UserError
from kvforge.store import open_store
from kvforge.store.codec import encode, segments_equal

SECRET = "s3cr3t-Pa55"
CASES: list[tuple[str, str, Callable[[Path], str], Callable[[str], bool]]] = []


def case(name: str, expected: str, ok: Callable[[str], bool]):
    def wrap(fn: Callable[[Path], str]) -> Callable[[Path], str]:
        CASES.append((name, expected, fn, ok))
        return fn

    return wrap


@case(
    "password in a store URL, Redis down, `kvforge cache stats`",
    "exit 2, one line, no password",
    lambda o: o == "2/1/no",
)
def password_in_cli(tmp: Path) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli(["cache", "stats", "--store", f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"])
    text = out.getvalue() + err.getvalue()
    return f"{rc}/{err.getvalue().count(chr(10))}/{'yes' if SECRET in text else 'no'}"


@case(
    "odd store URLs (1e400, /abc, file://rel, ?timeout=nan, unknown option)",
    "5 one-line UserErrors",
    lambda o: o == "5",
)
def odd_urls(tmp: Path) -> str:
    n = 0
    for url in ("memory://?max_bytes=1e400", "redis://h:1/abc", "file://rel/x", "redis://h:1/0?timeout=nan",
                "redis://h:1/0?socket_timout=1"):  # fmt: skip
        try:
            open_store(url)
        except UserError as e:
            n += "\n" not in str(e)
    return str(n)


@case("segment with one flipped header byte (every byte tried)", "0 accepted", lambda o: o.startswith("0 "))
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


@case("truncated segment file on disk", "miss (None), entry removed", lambda o: o == "None/False")
def truncated(tmp: Path) -> str:
    store = open_store(f"file://{tmp}/trunc")
    store.put("aa", make_segment())
    path = store.path("aa")  # type: ignore[attr-defined]
    path.write_bytes(path.read_bytes()[:-100])
    return f"{store.get('aa')}/{store.contains('aa')}"


@case(
    "read-only folder (?read_only=1): get / put / clear",
    "hit / skipped / one-line error",
    lambda o: o == "hit/skipped/error",
)
def read_only(tmp: Path) -> str:
    open_store(f"file://{tmp}/ro").put("aa", make_segment())
    store = open_store(f"file://{tmp}/ro?read_only=1")
    hit = "hit" if segments_equal(store.get("aa"), make_segment()) else "miss"
    store.put("bb", make_segment(seed=1))
    put = "skipped" if not store.contains("bb") else "written"
    try:
        store.clear()
        clear = "cleared"
    except UserError:
        clear = "error"
    return f"{hit}/{put}/{clear}"


def _two_writers(url: str, tmp: Path) -> str:
    """The concurrency test's two writer processes (25 prompts each), then who is indexed and found."""
    from test_semantic_index_concurrency import WRITER, _texts

    from kvforge.reuse import FakeEmbedder, SemanticReuse

    script = tmp / "writer.py"
    script.write_text(WRITER)
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    procs = [subprocess.Popen([sys.executable, str(script), url, w], env=env) for w in "AB"]
    if [p.wait(timeout=600) for p in procs] != [0, 0]:
        return "writer failed"
    reuse = SemanticReuse(open_store(url), "tiny", FakeEmbedder(), threshold=0.6)
    found = sum(not isinstance(reuse._find(text, ""), str) for text in _texts())
    return f"{len(reuse.index)} indexed, {found} found"


@case(
    "two processes x 25 semantic records, one file:// store",
    "50 indexed, 50 found",
    lambda o: o == "50 indexed, 50 found",
)
def semantic_file(tmp: Path) -> str:
    return _two_writers(f"file://{tmp}/sem", tmp)


def _redis_pid(url: str) -> int:
    port = url.split(":")[2].split("/")[0]
    out = subprocess.run(["pgrep", "-f", f"redis-server 127.0.0.1:{port}"], capture_output=True, text=True).stdout
    return int(out.split()[0])


@case("two processes x 25 semantic records, one Redis", "50 indexed, 50 found", lambda o: o == "50 indexed, 50 found")
def semantic_redis(tmp: Path) -> str:
    with redis_server(tmp) as url:
        return _two_writers(url, tmp)


@case("Redis SIGSTOP'd (hung), timeout=0.5: get + put + get", "misses, < 3 s, one warning", lambda o: o.endswith("/1"))
def hung_redis(tmp: Path) -> str:
    with redis_server(tmp) as url:
        store = open_store(url + "?timeout=0.5&connect_timeout=0.5")
        store.put("aa", make_segment())
        pid = _redis_pid(url)
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        kv_logger = logging.getLogger("kvforge")
        kv_logger.addHandler(handler)
        level, kv_logger.level = kv_logger.level, logging.WARNING
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            got = [store.get("aa"), store.put("bb", make_segment()), store.get("bb")]
            elapsed = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
            kv_logger.removeHandler(handler)
            kv_logger.setLevel(level)
        misses = "misses" if got[0] is None and got[2] is None else "hits?"
        warned = sum("unavailable" in r.getMessage() for r in records)
        return f"{misses}/{elapsed:.1f}s/{'<3s' if elapsed < 3 else '>=3s'}/{warned}"


@case(
    "Redis writer process SIGKILLed at random moments (3 times, real redis-server)",
    "every visible entry whole; every unreferenced chunk has a TTL",
    lambda o: o.startswith("whole/ttl"),
)
def redis_sigkill(tmp: Path) -> str:
    import random

    from test_store_redis import WRITER

    from kvforge.store.redis import RedisStore

    rng = random.Random(0)
    with redis_server(tmp) as url:
        script = tmp / "writer.py"
        script.write_text(WRITER)
        env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
        partial = orphans = mid_data = 0
        for _ in range(3):
            tests = str(Path(__file__).resolve().parents[1] / "tests")
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


@case(
    "disk store in the pre-hash layout (segments/<key[:2]>/), reopened",
    "moved to hashed folders, every entry a hit, LRU order kept",
    lambda o: o == "moved/3 hits/order kept",
)
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


@case(
    "full disk while creating a shard folder (ENOSPC at mkdir), 3 writes",
    "no exception, writes skipped, one warning",
    lambda o: o == "ok/skipped/1",
)
def full_disk_shard(tmp: Path) -> str:
    from store_helpers import full_disk_at_shard_folders

    from kvforge.store.disk import DiskStore

    store = DiskStore(tmp / "full")
    try:
        with _warnings() as records, full_disk_at_shard_folders():
            for i in range(3):
                store.put(f"key{i}", make_segment(seed=i))
        outcome = "ok"
    except Exception as e:
        outcome = type(e).__name__
    return f"{outcome}/{'skipped' if not store.keys() else 'written'}/{sum('no space' in m for m in records)}"


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """The messages of the warnings kvforge logs inside the block (whatever the logging configuration)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    kv_logger = logging.getLogger("kvforge")
    level = kv_logger.level
    kv_logger.addHandler(handler)
    kv_logger.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        kv_logger.removeHandler(handler)
        kv_logger.setLevel(level)


@case(
    "semantic index: 2 of 8 records deleted, 2 with a flipped byte, then reopened",
    "8 of 8 found (rebuilt from the segments' headers)",
    lambda o: o == "8 of 8 found",
)
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
    found = sum(not isinstance(reopened._find(t, ""), str) for t in texts)
    return f"{found} of {len(texts)} found"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/faults.jsonl"))
    ap.add_argument("--only", default=None, help="run only the cases whose name contains this text")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, expected, fn, ok in CASES:
        if args.only is not None and args.only not in name:
            continue
        tmp = Path(tempfile.mkdtemp(prefix="kvforge-faults-"))
        try:
            if "Redis" in name and shutil.which("redis-server") is None:
                observed, passed = "skipped: redis-server not on PATH", None
            else:
                observed = fn(tmp)
                passed = ok(observed)
        except Exception as e:  # a fault case that crashes is a failed case, reported as such
            observed, passed = f"crashed: {type(e).__name__}: {e}", False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        rows.append({"case": name, "expected": expected, "observed": observed, "ok": passed})
        print(json.dumps(rows[-1]), flush=True)
    with args.out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row | {"time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    print("\n| case | expected | observed | ok |\n|---|---|---|---|")
    for r in rows:
        verdict = "yes" if r["ok"] else "skipped" if r["ok"] is None else "NO"
        print(f"| {r['case']} | {r['expected']} | {r['observed']} | {verdict} |")
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
