"""Helpers for the store tests: tiny random KV segments and a real redis-server on 127.0.0.1 on a free port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvforge.types import KVSegment


def make_segment(
    dtype: torch.dtype = torch.float32,
    lengths: tuple[int, ...] = (7, 3, 0),
    num_heads: int = 2,
    head_dim: int = 8,
    masked: bool = True,
    seed: int = 0,
    model_id: str = "tiny-model",
    meta: dict | None = None,
) -> KVSegment:
    """A segment with ragged layers, per-head positions on one layer and a valid mask on another."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = max(lengths) if lengths else 0
    keys, values, positions, valid = [], [], [], []
    for i, s in enumerate(lengths):
        keys.append(torch.randn(num_heads, s, head_dim, generator=g).to(dtype))
        values.append(torch.randn(num_heads, s, head_dim, generator=g).to(dtype))
        if i == 1:  # head-wise selection: each head keeps different positions
            pos = torch.stack([torch.randperm(num_tokens, generator=g)[:s].sort().values for _ in range(num_heads)])
        else:
            pos = torch.arange(s).expand(num_heads, s).clone()
        positions.append(pos)
        valid.append(torch.rand(num_heads, s, generator=g) > 0.3 if masked and i == 1 else None)
    return KVSegment(
        token_ids=list(range(10, 10 + num_tokens)),
        keys=keys,
        values=values,
        positions=positions,
        valid=valid,
        next_position=num_tokens,
        model_id=model_id,
        meta={"press": {"name": "snapkv", "compression_ratio": 0.5}} if meta is None else meta,
    )


def forge(data: bytes, header: Callable[[dict], None] = lambda h: None,
          tensors: Callable[[dict], None] = lambda t: None) -> bytes:  # fmt: skip
    """``data`` (an encoded segment) with its header and tensors edited, every checksum made valid again: what
    someone who can write the store can make."""
    import json

    from kvforge.store import codec, payload
    from kvforge.store.checksum import checksum

    parsed = codec._parse(data)
    found = dict(payload.read_payload(memoryview(bytearray(data)), (parsed.index, parsed.start)))
    tensors(found)
    index, buffers = payload.tensor_index(found)
    h = {k: v for k, v in parsed.header.items() if k != "header_checksum"}
    header(h)
    algo = h["checksum_algo"]
    h["payload_bytes"] = sum(len(b) for b in buffers)
    h["checksum"] = checksum([payload.index_json(index), *buffers], algo)
    h["header_checksum"] = checksum([codec._header_json(h)], algo)
    raw = json.dumps(h, separators=(",", ":"))
    return b"".join(bytes(p) for p in payload.write_parts(index, buffers, {codec.METADATA_KEY: raw}))


def redis_chunk_audit(url: str, prefix: str) -> tuple[set[str], set[str], dict[str, int]]:
    """What a Redis store under ``prefix`` holds: (data keys its metadata points to, data keys present, TTL of each
    data key present). Committed chunks have no TTL; any other chunk must expire."""
    import json

    import redis

    client = redis.Redis.from_url(url)
    live: set[str] = set()
    for name in client.scan_iter(f"{prefix}:*:meta"):
        meta = json.loads(client.get(name))
        base = name.decode().removesuffix(":meta")
        live |= {f"{base}:data:{meta['nonce']}:{i}" for i in range(meta["chunks"])}
    data = {k.decode() for k in client.scan_iter(f"{prefix}:*:data:*")}
    return live, data, {k: client.ttl(k) for k in data}


@contextmanager
def full_disk_at_shard_folders() -> Iterator[None]:
    """Inside the block, creating a new folder under a disk store's ``segments/`` fails with ENOSPC (a full disk)."""
    import errno

    real_mkdir = Path.mkdir

    def full(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.parent.name == "segments" and not self.exists():
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        real_mkdir(self, *args, **kwargs)

    Path.mkdir = full  # type: ignore[method-assign]
    try:
        yield
    finally:
        Path.mkdir = real_mkdir  # type: ignore[method-assign]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server(workdir: Path, password: str | None = None) -> Iterator[str]:
    """Run ``redis-server`` on 127.0.0.1 on a free port (no persistence; with ``password``: ``requirepass``); yields
    its URL (without the password)."""
    exe = shutil.which("redis-server")
    if exe is None:
        import pytest

        pytest.skip("redis-server is not on PATH (apt-get install redis-server); Redis tests skipped")
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)]
        + (["--requirepass", password] if password else []),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_until_up(port, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_until_up(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not answer on port {port} within {timeout_s} s")
