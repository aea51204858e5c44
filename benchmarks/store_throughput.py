"""Store write/read throughput (MB/s) for KV segments the size of a real model's cache, against a plain file read.

Segments are random tensors shaped like smollm2-135m's cache (30 layers, 3 KV heads, head dim 64, fp32 by default:
2 * 30 * 3 * 64 * 4 = 46,080 bytes per token) at 1k/4k/8k tokens. Each store is timed on ``put`` (encode + write)
and ``get`` (read + checksum + decode to tensors). Each store is compared, in the same run and in alternation, with
the transport's own limit for the same bytes: a plain ``readinto`` of a file into fresh memory (disk, memory; for disk
also into a buffer read into before, ``read_vs_file_reused``: the copy alone, no page faults), and for Redis a plain
redis-py pipeline that SETs / GETs the same bytes in the same chunks (no metadata, no checksum, no decode). The ratios
``read_vs_file``, ``read_vs_plain_redis`` and ``write_vs_plain_redis`` are store speed / baseline speed (1.0 = at the
limit). "cold" reads first drop the file from the page cache (``posix_fadvise(DONTNEED)``).

    PYTHONPATH=src python benchmarks/store_throughput.py --lengths 1024,4096,8192 --backends memory,disk,redis

One JSON line per (backend, length) on stdout and appended to results/performance/store_throughput.jsonl, then a
table of the ratios.
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
from common import RESULTS

from kvforge.provenance import git_sha
from kvforge.store import DiskStore, MemoryStore
from kvforge.store.base import parse_size
from kvforge.store.codec import encode
from kvforge.types import KVSegment

OUT = RESULTS / "performance" / "store_throughput.jsonl"


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
    return alternating([fn], repeats, before)[0]


def alternating(
    fns: list[Callable[[], object]],
    repeats: int,
    before: Callable[[], None] | None = None,
    cpu: list[float] | None = None,
) -> list[float]:
    """Median wall time of each of ``fns``, run in turn ``repeats`` times (so load changes hit them alike); ``cpu``,
    when given, receives the median CPU time of this process for each (what other jobs on a shared machine do not
    inflate, for single-threaded work)."""
    times: list[list[float]] = [[] for _ in fns]
    cpu_times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out, out_cpu in zip(fns, times, cpu_times, strict=True):
            if before is not None:
                before()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            out.append(time.perf_counter() - start)
            out_cpu.append(time.process_time() - start_cpu)
    if cpu is not None:
        cpu[:] = [statistics.median(t) for t in cpu_times]
    return [statistics.median(t) for t in times]


def plain_redis(url: str, data: bytes, chunk_bytes: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """(write, read) of ``data`` with a plain redis-py pipeline in ``chunk_bytes`` values: the transport's limit."""
    import redis

    client = redis.Redis.from_url(url)
    view = memoryview(data)
    names = [f"plain:bench:{i}" for i in range(-(-len(data) // chunk_bytes))]

    def write() -> object:
        pipe = client.pipeline(transaction=False)
        for i, name in enumerate(names):
            pipe.set(name, view[i * chunk_bytes : (i + 1) * chunk_bytes])
        return pipe.execute()

    def read() -> object:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        return pipe.execute()

    return write, read


def drop_cache(path: Path) -> None:
    """Evict a file from the page cache, so the next read comes from the device."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_file(path: Path, into: np.ndarray | None = None) -> np.ndarray:
    """The fastest plain read: one ``readinto`` into uninitialised fresh memory, or into ``into`` (memory already
    mapped, whose pages the kernel need not fault in and zero first)."""
    with open(path, "rb", buffering=0) as f:
        data = np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8) if into is None else into
        f.readinto(memoryview(data))
    return data


def write_file(path: Path, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            os.fsync(f.fileno())


@contextlib.contextmanager
def local_redis(workdir: Path, port: int | None = None) -> Iterator[str | None]:
    """A throwaway redis-server on ``port`` (default: a free one), or None when it is not installed."""
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    if port is None:
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

        kwargs = {} if args.chunk_bytes is None else {"chunk_bytes": parse_size(args.chunk_bytes)}
        return RedisStore(redis_url, quant=args.quant, **kwargs)
    raise SystemExit(f"unknown backend {backend!r}")


def run_length(num_tokens: int, args: argparse.Namespace, workdir: Path, redis_url: str | None) -> list[dict]:
    """All backends at one segment length, plus the plain-file baselines."""
    dtype = getattr(torch, args.dtype)
    seg = make_segment(num_tokens, args.num_layers, args.num_kv_heads, args.head_dim, dtype)
    stored = encode(seg, args.quant)
    mb = len(stored) / 1e6
    plain = workdir / "plain.bin"
    file_write_s = timed(lambda: write_file(plain, stored, fsync=True), args.repeats)
    file_cold_s = timed(lambda: read_file(plain), args.repeats, before=lambda: drop_cache(plain))
    rows = []
    for backend in args.backends.split(","):
        store = open_backend(backend, args, workdir, redis_url, len(stored))
        if store is None:
            continue
        key = f"bench{num_tokens}"
        row: dict = {}
        if backend == "redis":
            plain_write, plain_read = plain_redis(redis_url, stored, store.chunk_bytes)  # type: ignore[arg-type]
            put_s, plain_write_s = alternating([lambda s=store, k=key: s.put(k, seg), plain_write], args.repeats)
            get_s, plain_read_s, file_read_s = alternating(
                [lambda s=store, k=key: s.get(k), plain_read, lambda: read_file(plain)], args.repeats
            )
            store.client.delete(*[f"plain:bench:{i}" for i in range(-(-len(stored) // store.chunk_bytes))])
            row |= {
                "plain_redis_write_mb_s": mb / plain_write_s, "plain_redis_read_mb_s": mb / plain_read_s,
                "write_vs_plain_redis": plain_write_s / put_s, "read_vs_plain_redis": plain_read_s / get_s,
                "chunk_bytes": store.chunk_bytes,
            }  # fmt: skip
        else:
            put_s = timed(lambda s=store, k=key: s.put(k, seg), args.repeats)
            reused = read_file(plain)  # the recycled-memory baseline reads into this buffer again and again
            cpu: list[float] = []
            get_s, file_read_s, file_reused_s = alternating(
                [lambda s=store, k=key: s.get(k), lambda: read_file(plain), lambda b=reused: read_file(plain, b)],
                args.repeats,
                cpu=cpu,
            )
            row |= {
                "file_read_reused_mb_s": mb / file_reused_s, "read_vs_file_reused": file_reused_s / get_s,
                "read_vs_file_cpu": cpu[1] / cpu[0], "read_vs_file_reused_cpu": cpu[2] / cpu[0],
                "get_cpu_s": cpu[0], "file_read_cpu_s": cpu[1], "file_read_reused_cpu_s": cpu[2],
            }  # fmt: skip
        cold_s = None
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
            "read_vs_file": file_read_s / get_s, **row,
            "put_s": put_s, "get_s": get_s, "repeats": args.repeats,
            "git": git_sha(), "device": f"{platform.machine()} x{os.cpu_count()}", "torch": torch.__version__,
            "load_avg_1m": os.getloadavg()[0], "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })  # fmt: skip
    plain.unlink()
    return rows


def print_table(rows: list[dict]) -> None:
    """Store speed against the transport's limit, measured in the same run."""
    print("\n| tokens (MB) | backend | read MB/s | read / plain file read (CPU time) "
          "| read / read into reused memory (CPU time) "
          "| read / plain redis-py pipeline | write / plain redis-py pipeline |\n" + "|---" * 7 + "|")  # fmt: skip
    for r in rows:
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(f"| {r['num_tokens']} ({r['stored_bytes'] / 1e6:.0f}) | {r['backend']} | {r['read_mb_s']:.0f} | "
              f"{fmt(r['read_vs_file'])} ({fmt(r.get('read_vs_file_cpu'))}) | "
              f"{fmt(r.get('read_vs_file_reused'))} ({fmt(r.get('read_vs_file_reused_cpu'))}) | "
              f"{fmt(r.get('read_vs_plain_redis'))} | {fmt(r.get('write_vs_plain_redis'))} |")  # fmt: skip


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
    parser.add_argument("--redis-port", type=int, default=None, help="port of the local redis-server (default: free)")
    parser.add_argument("--chunk-bytes", default=None, help="the Redis store's chunk_bytes (default: the store's)")
    parser.add_argument("--dir", default=None, help="folder for the disk store and the plain file (default: a tmp dir)")
    parser.add_argument("--no-save", action="store_true", help="do not append to results/performance/")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvbench-", dir=args.dir))
    try:
        with contextlib.ExitStack() as stack:
            redis_url = args.redis_url
            if "redis" in args.backends.split(",") and redis_url is None:
                redis_url = stack.enter_context(local_redis(workdir, args.redis_port))
            rows = []
            for num_tokens in (int(x) for x in args.lengths.split(",")):
                for row in run_length(num_tokens, args, workdir, redis_url):
                    rows.append(row)
                    line = json.dumps(row)
                    print(line, flush=True)
                    if not args.no_save:
                        OUT.parent.mkdir(parents=True, exist_ok=True)
                        with open(OUT, "a") as f:
                            f.write(line + "\n")
            print_table(rows)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
