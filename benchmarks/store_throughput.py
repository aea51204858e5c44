"""Store write/read throughput (MB/s) for KV segments the size of a real model's cache, against a plain file read.

Segments are random tensors shaped like smollm2-135m's cache (30 layers, 3 KV heads, head dim 64, fp32 by default:
2 * 30 * 3 * 64 * 4 = 46,080 bytes per token) at 1k/4k/8k tokens. Each store is timed on ``put`` (encode + write)
and ``get`` (read + checksum + decode to tensors); the physical limit is a plain ``readinto`` of a file holding the
same bytes. "cold" reads first drop the file from the page cache (``posix_fadvise(DONTNEED)``).

    PYTHONPATH=src python benchmarks/store_throughput.py --lengths 1024,4096,8192 --backends memory,disk,redis

One JSON line per (backend, length) on stdout and appended to benchmarks/results/store_throughput.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from kvforge.store import DiskStore, MemoryStore
from kvforge.store.codec import encode
from kvforge.types import KVSegment

RESULTS = Path(__file__).parent / "results" / "store_throughput.jsonl"


def make_segment(num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVSegment:
    keys = [torch.randn(num_kv_heads, num_tokens, head_dim).to(dtype) for _ in range(num_layers)]
    values = [torch.randn(num_kv_heads, num_tokens, head_dim).to(dtype) for _ in range(num_layers)]
    positions = [torch.arange(num_tokens).expand(num_kv_heads, -1).clone() for _ in range(num_layers)]
    return KVSegment(
        token_ids=list(range(num_tokens)), keys=keys, values=values, positions=positions,
        valid=[None] * num_layers, next_position=num_tokens, model_id="smollm2-135m-bench",
    )  # fmt: skip


def timed(fn: Callable[[], object], repeats: int, before: Callable[[], None] | None = None) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (``before`` runs untimed before each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def drop_cache(path: Path) -> None:
    """Evict a file from the page cache, so the next read comes from the device."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_file(path: Path) -> np.ndarray:
    """The fastest plain read: one ``readinto`` into uninitialised memory."""
    with open(path, "rb", buffering=0) as f:
        data = np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8)
        f.readinto(memoryview(data))
    return data


def write_file(path: Path, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            os.fsync(f.fileno())


@contextlib.contextmanager
def local_redis(workdir: Path) -> Iterator[str | None]:
    """A throwaway redis-server on a free port, or None when it is not installed."""
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def open_backend(backend: str, args: argparse.Namespace, workdir: Path, redis_url: str | None, nbytes: int):  # type: ignore[no-untyped-def]
    """The store to time, or None when it cannot run here."""
    if backend == "memory":
        return MemoryStore(max_bytes=4 * nbytes, quant=args.quant)
    if backend in ("disk", "disk-nofsync"):
        return DiskStore(workdir / "disk", fsync=backend == "disk", quant=args.quant)
    if backend == "redis":
        if redis_url is None:
            print("redis-server not found and no --redis-url: skipping redis", file=sys.stderr)
            return None
        from kvforge.store.redis import RedisStore

        return RedisStore(redis_url, quant=args.quant)
    raise SystemExit(f"unknown backend {backend!r}")


def run_length(num_tokens: int, args: argparse.Namespace, workdir: Path, redis_url: str | None) -> list[dict]:
    """All backends at one segment length, plus the plain-file baselines."""
    dtype = getattr(torch, args.dtype)
    seg = make_segment(num_tokens, args.num_layers, args.num_kv_heads, args.head_dim, dtype)
    stored = encode(seg, args.quant)
    mb = len(stored) / 1e6
    plain = workdir / "plain.bin"
    file_write_s = timed(lambda: write_file(plain, stored, fsync=True), args.repeats)
    file_read_s = timed(lambda: read_file(plain), args.repeats)
    file_cold_s = timed(lambda: read_file(plain), args.repeats, before=lambda: drop_cache(plain))
    plain.unlink()
    rows = []
    for backend in args.backends.split(","):
        store = open_backend(backend, args, workdir, redis_url, len(stored))
        if store is None:
            continue
        key = f"bench{num_tokens}"
        put_s = timed(lambda s=store, k=key: s.put(k, seg), args.repeats)
        get_s = timed(lambda s=store, k=key: s.get(k), args.repeats)
        cold_s = transport_s = None
        if backend == "redis":  # the transport alone: fetch the chunks, no join, no checksum, no decode
            chunk_keys = store._chunk_keys(key, "seg", store._meta(key, "seg"))
            transport_s = timed(lambda s=store, c=chunk_keys: s.client.mget(c), args.repeats)
        if isinstance(store, DiskStore):
            path = store.path(key)
            cold_s = timed(lambda s=store, k=key: s.get(k), args.repeats, before=lambda p=path: drop_cache(p))
        store.delete(key)
        store.close()
        rows.append({
            "bench": "store_throughput", "backend": backend, "num_tokens": num_tokens, "dtype": args.dtype,
            "quant": args.quant, "full_bytes": seg.nbytes(), "stored_bytes": len(stored),
            "bytes_per_token": seg.nbytes() / num_tokens, "write_mb_s": mb / put_s, "read_mb_s": mb / get_s,
            "read_cold_mb_s": None if cold_s is None else mb / cold_s, "file_write_fsync_mb_s": mb / file_write_s,
            "file_read_mb_s": mb / file_read_s, "file_read_cold_mb_s": mb / file_cold_s,
            "read_vs_file": file_read_s / get_s,
            "redis_transport_read_mb_s": None if transport_s is None else mb / transport_s,
            "put_s": put_s, "get_s": get_s, "repeats": args.repeats,
            "git": git_sha(), "device": f"{platform.machine()} x{os.cpu_count()}", "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,8192", help="segment lengths in tokens")
    parser.add_argument("--backends", default="memory,disk,redis", help="subset of memory,disk,disk-nofsync,redis")
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--quant", default=None, help="int8-channel, int8-token or int8-kivi (default: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis-url", default=None, help="use this server instead of starting a local redis-server")
    parser.add_argument("--dir", default=None, help="folder for the disk store and the plain file (default: a tmp dir)")
    parser.add_argument("--no-save", action="store_true", help="do not append to benchmarks/results/")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvbench-", dir=args.dir))
    try:
        with contextlib.ExitStack() as stack:
            redis_url = args.redis_url
            if "redis" in args.backends.split(",") and redis_url is None:
                redis_url = stack.enter_context(local_redis(workdir))
            for num_tokens in (int(x) for x in args.lengths.split(",")):
                for row in run_length(num_tokens, args, workdir, redis_url):
                    line = json.dumps(row)
                    print(line, flush=True)
                    if not args.no_save:
                        RESULTS.parent.mkdir(parents=True, exist_ok=True)
                        with open(RESULTS, "a") as f:
                            f.write(line + "\n")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
