"""Cases of input others can write or send: a shared store folder or Redis database holding hostile entries, abusive
connections, a router's upstream that fails or carries a password, keys and stream options."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
from store_helpers import forge, make_segment

from fault_cases import Case, cached, complete, equals, note, server, starts, warnings_logged
from fault_cases.serve import _health_probe
from kvforge.store import DiskStore
from kvforge.store.codec import encode

MIB = 1 << 20


# ------------------------------------------------------------------------------------------------ hostile entries
def _huge_shapes(data: bytes) -> bytes:
    """Valid checksums, a header declaring 10^9 tokens per layer."""

    def edit(h: dict) -> None:
        for info in h["layers"]:
            info["k_shape"][1] = info["v_shape"][1] = 10**9

    return forge(data, edit)


def _bomb(data: bytes) -> bytes:
    """Valid checksums, layer 0 declared head-wise with a mask that inflates to 256 MiB."""
    import torch

    def edit(h: dict) -> None:
        h["version"] = max(h["version"], 4)
        h["layers"][0] |= {"layout": "packed", "valid": True, "p_layout": "delta-deflate"}

    bomb = torch.frombuffer(bytearray(zlib.compress(bytes(256 * MIB), 9)), dtype=torch.uint8)
    return forge(data, edit, lambda t: t.__setitem__("m.0", bomb))


def _basis_path(data: bytes) -> bytes:
    return forge(data, lambda h: h.__setitem__("basis", "../../../../../../etc/passwd"))


def _seed_hostile(folder: Path, outside: Path) -> dict[str, int]:
    """Replace every segment file under ``folder`` by a hostile one, kinds in turn; the count of each kind."""
    kinds = ("fifo", "symlink", "huge-shapes", "deflate-bomb", "sparse-2GiB-garbage", "basis-path")
    counts = dict.fromkeys(kinds, 0)
    outside.mkdir(exist_ok=True)
    files = sorted((folder / "segments").glob("*/*.kvseg"))
    for i, path in enumerate(files):
        kind = kinds[i % len(kinds)]
        data = path.read_bytes()
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink":
            target = outside / f"{i}.kvseg"
            target.write_bytes(data)  # a valid entry, but outside the store
            path.symlink_to(target)
        elif kind == "sparse-2GiB-garbage":
            with open(path, "wb") as f:
                f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header, ")
                f.truncate(2 << 30)
        else:
            forged = {"huge-shapes": _huge_shapes, "deflate-bomb": _bomb, "basis-path": _basis_path}[kind]
            path.write_bytes(forged(data))
        counts[kind] += 1
    (folder / "segments" / "zz").symlink_to(outside)  # a shard folder (of the former layout) linked outside
    (outside / "zz0123.kvseg").write_bytes(b"not ours")
    (folder / "segments" / "00" / "bad name!.kvseg").parent.mkdir(exist_ok=True)
    (folder / "segments" / "00" / "bad name!.kvseg").write_bytes(b"x")  # a name that is not a key
    return counts


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


PROMPTS = ["".join(f"Shelf {i} of aisle {a} holds item {(i * 37 + a) % 1000:03d}. " for i in range(12))
           for a in range(6)]  # fmt: skip


def _serve_prompts(store: str) -> tuple[list[int], float, float, str]:
    """Each prompt twice on a prefix-reuse server over ``store``: statuses, worst /health, peak RSS (MiB), log."""
    with server("--reuse", "prefix", store=store) as srv, _health_probe(srv) as worst:
        statuses = []
        for prompt in PROMPTS:
            statuses += [complete(srv, prompt).status_code, cached(complete(srv, prompt))]
        peak = _peak_rss_mib(srv.proc.pid)
    return statuses, worst[0], peak, srv.output


def hostile_store_server(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    clean = tmp / "clean"
    _, _, clean_peak, _ = _serve_prompts(f"file://{clean}")
    hostile, outside = tmp / "hostile", tmp / "outside"
    shutil.copytree(clean, hostile, symlinks=True)
    counts = _seed_hostile(hostile, outside)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    statuses, worst, peak, log = _serve_prompts(f"file://{hostile}")
    firsts, repeats = statuses[0::2], statuses[1::2]
    untouched = {p.name: p.read_bytes() for p in outside.iterdir()} == before
    tracebacks = log.count("Traceback")
    ok = (all(s == 200 for s in firsts) and all(r > 0 for r in repeats) and worst <= 0.5
          and peak <= 1.5 * clean_peak and tracebacks == 0 and untouched)  # fmt: skip
    text = (
        f"{'ok' if ok else 'FAILED'}: {sum(counts.values())} hostile entries {counts}; "
        f"statuses {sorted(set(firsts))}, repeats hit {sum(r > 0 for r in repeats)}/{len(repeats)}; "
        f"/health worst {worst:.2f} s; peak RSS {peak:.0f} MiB vs clean {clean_peak:.0f} MiB "
        f"({peak / clean_peak:.2f}x); {tracebacks} tracebacks; "
        f"outside files {'untouched' if untouched else 'CHANGED'}; {log.count('WARNING')} warning lines"
    )
    return text, {"hostile-store": firsts}


def fifo_commands(tmp: Path) -> str:
    folder = tmp / "kv"
    store = DiskStore(folder, fsync=False)
    store.put("good", make_segment())
    os.mkfifo(store.path("good").parent / "fifo.kvseg")
    (folder / "blobs").mkdir()
    os.mkfifo(folder / "blobs" / "index.blob")
    codes = []
    for command in ("ls", "stats", "clear"):
        proc = subprocess.run([sys.executable, "-m", "kvforge.cli", "cache", command, "--store", f"file://{folder}"],
                              capture_output=True, text=True, timeout=60, env=_env())  # fmt: skip
        codes.append(str(proc.returncode))
    kept = (store.path("good").parent / "fifo.kvseg").exists() and (folder / "blobs" / "index.blob").exists()
    return f"{'/'.join(codes)}; fifos {'kept' if kept else 'removed'}"


def _env() -> dict[str, str]:
    from os_faults import python_env

    return python_env()


_READER = r"""
import json, resource, sys, time
from kvforge.store import DiskStore
store = DiskStore(sys.argv[1], fsync=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.monotonic()
out = {"miss": store.get(sys.argv[2]) is None}
out["seconds"] = round(time.monotonic() - t, 3)
out["extra_mib"] = round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, 1)
print(json.dumps(out))
"""


def _read_in_child(folder: Path, key: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _READER, str(folder), key], capture_output=True, text=True,
                          timeout=300, env=_env())  # fmt: skip
    if proc.returncode != 0:
        return {"miss": False, "seconds": -1, "extra_mib": -1, "error": proc.stderr[-300:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def forged_sizes(tmp: Path) -> str:
    folder = tmp / "kv"
    store = DiskStore(folder, fsync=False)
    data = encode(make_segment(lengths=(64, 64), masked=False))
    store.write("shapes", _huge_shapes(data))
    store.write("bomb", _bomb(data))
    sparse = store.path("sparse")
    sparse.parent.mkdir(parents=True, exist_ok=True)
    with open(sparse, "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage garbage")
        f.truncate(2 << 30)
    rows = {key: _read_in_child(folder, key) for key in ("shapes", "bomb", "sparse")}
    ok = all(r["miss"] and 0 <= r["extra_mib"] < 64 and 0 <= r["seconds"] < 1 for r in rows.values())
    detail = ", ".join(f"{k}: {'miss' if r['miss'] else 'NOT a miss'} +{r['extra_mib']} MiB {r['seconds']} s"
                       for k, r in rows.items())  # fmt: skip
    return f"{'ok' if ok else 'FAILED'}: {detail}"


def links_out(tmp: Path) -> str:
    from kvforge.cli import main as cli
    from kvforge.store.disk import shard

    outside = tmp / "outside"
    outside.mkdir()
    folder = tmp / "kv"
    store = DiskStore(folder, fsync=False)
    store.put("good", make_segment())
    data = encode(make_segment())
    (outside / "victim.kvseg").write_bytes(data)
    (folder / "segments" / shard("linked")).mkdir(exist_ok=True)
    (folder / "segments" / shard("linked") / "linked.kvseg").symlink_to(outside / "victim.kvseg")
    for name, key in ((shard("other"), "other"), ("ot", "ot1")):
        if not (folder / "segments" / name).exists():
            (folder / "segments" / name).symlink_to(outside)
        (outside / f"{key}.kvseg").write_bytes(data)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    store = DiskStore(folder, fsync=False)
    misses = sum(store.get(k) is None for k in ("linked", "other", "ot1"))
    store.put("other2", make_segment(seed=2))
    with warnings_logged():
        cli(["cache", "clear", "--store", f"file://{folder}"])
    after = {p.name: p.read_bytes() for p in outside.iterdir()}
    return f"{misses} misses; outside {'untouched' if after == before else 'CHANGED'}"


# ------------------------------------------------------------------------------------------------ Redis values
def _fake_redis() -> tuple[Any, Any]:
    import fakeredis

    from kvforge.store import redis as redis_store

    fake = fakeredis.FakeServer()
    real = redis_store.client_from_url
    redis_store.client_from_url = lambda *a, **k: fakeredis.FakeRedis(server=fake)  # type: ignore[assignment]
    try:
        store = redis_store.RedisStore("redis://127.0.0.1:1/0")
    finally:
        redis_store.client_from_url = real  # type: ignore[assignment]
    store.client.info = lambda *a: {}  # not in fakeredis
    return store, fakeredis.FakeRedis(server=fake)


def redis_values(tmp: Path) -> str:
    from kvforge.reuse import FakeEmbedder, SemanticReuse

    store, raw = _fake_redis()
    store.put("aa", make_segment())
    meta = json.loads(raw.get("kvforge:seg:aa:meta"))
    forged = {"many": meta | {"chunks": 3_000_000, "bytes": 3_000_000}, "text": meta | {"chunks": "1"},
              "nonce": meta | {"nonce": "../../x"}}  # fmt: skip
    for key, m in forged.items():
        raw.set(f"kvforge:seg:{key}:meta", json.dumps(m))
        raw.zadd("kvforge:seg:lru", {key: 1.0})
    raw.hset("kvforge:blob:sizes", "semantic-v1-rec-../../bad", 5)
    raw.hset("kvforge:seg:sizes", "bad name!", "lots")
    raw.zadd("kvforge:seg:lru", {"bad name!": 2.0})
    with warnings_logged() as warned:
        t = time.monotonic()
        misses = sum(store.get(k) is None for k in forged)
        seconds = time.monotonic() - t
        gone = sum(raw.get(f"kvforge:seg:{k}:meta") is None for k in forged)
        stats = store.stats(deep=True)
        semantic = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)
        lookup = semantic.lookup("anything")
    ok = misses == gone == 3 and seconds < 1 and stats["entries"] == 1 and isinstance(lookup, str | type(None))
    return (f"{'ok' if ok else 'FAILED'}: {misses} misses in {seconds:.2f} s, {gone} removed; "
            f"stats: {stats['entries']} entries, {stats['bytes']} bytes; semantic reuse started; "
            f"{len(warned)} warnings")  # fmt: skip


def old_index_garbage(tmp: Path) -> str:
    from kvforge.reuse import FakeEmbedder, SemanticReuse
    from kvforge.reuse.index import MAGIC, IndexEntry, record_bytes

    store = DiskStore(tmp / "kv", fsync=False)
    probe = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)
    dim = FakeEmbedder().dim
    header = json.dumps({"dim": dim, "next_id": 1, "entries": {"0": {"key": "k0", "text": "t"}}}).encode()
    store.put_blob(probe.index_key, MAGIC + len(header).to_bytes(8, "little") + header + b"IxM2" + os.urandom(4096))
    import numpy as np

    vector = np.ones(dim, dtype=np.float32) / np.sqrt(dim)
    store.put_blob(probe.record_prefix + "x", record_bytes(vector, IndexEntry("../../x", "text")))
    with warnings_logged() as warned:
        semantic = SemanticReuse(store, "tiny", FakeEmbedder(), threshold=0.6)
    ok = len(semantic.index) == 0 and any("FAISS body" in w for w in warned)
    return f"{'ok' if ok else 'FAILED'}: started, {len(semantic.index)} indexed, {len(warned)} warnings"


# ------------------------------------------------------------------------------------------------ byte budget
_WRITER = r"""
import sys
from store_helpers import make_segment
from kvforge.store import DiskStore
s = DiskStore(sys.argv[1], max_bytes=int(sys.argv[2]), fsync=False)
w = sys.argv[3]
for i in range(60):
    s.put(f"{w}{i}", make_segment(seed=i, lengths=(200, 200), num_heads=4, head_dim=32))
"""


def _disk_bytes(folder: Path) -> int:
    """Bytes the store's segments and partial writes hold on disk now (a sparse reservation counts what is written)."""
    total = 0
    for sub in ("segments", "tmp"):
        for p in (folder / sub).rglob("*"):
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue
            if p.is_file():
                total += min(st.st_size, st.st_blocks * 512) if sub == "tmp" else st.st_size
    return total


def shared_budget(tmp: Path) -> str:
    size = len(encode(make_segment(lengths=(200, 200), num_heads=4, head_dim=32)))
    limit = 8 * size
    folder = tmp / "kv"
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _disk_bytes(folder))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(folder), str(limit), w], env=_env()) for w in "ABC"]
    codes = [p.wait(300) for p in procs]
    stop.set()
    sampler.join()
    return f"peak {peak[0] / limit:.2f}x max_bytes ({peak[0]} of {limit} bytes; writers exited {codes})"


# ------------------------------------------------------------------------------------------------ connections
def idle_connections(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    with server("--read-timeout", "3", preexec=limit) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        socks, statuses = [], []
        for _ in range(1100):
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
            socks.append(s)
        start = time.monotonic()
        for s in socks:
            data = b""
            with contextlib.suppress(ConnectionResetError):  # counted as no answer (status 0)
                while chunk := s.recv(4096):
                    data += chunk
            statuses.append(int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0)
            s.close()
        closed_s = time.monotonic() - start
        health = note(httpx.get(srv.url + "/health", timeout=10)).status_code
    lines = len(srv.output.splitlines())
    counts = {code: statuses.count(code) for code in sorted(set(statuses))}
    tracebacks = srv.output.count("Traceback")
    ok = set(counts) <= {503, 408} and closed_s < 10 and health == 200 and lines < 20 and tracebacks == 0
    text = (f"{'ok' if ok else 'FAILED'}: answers {counts}, all closed {closed_s:.1f} s after the last was opened; "
            f"/health {health}; {lines} log lines")  # fmt: skip
    return text, {"too-many-connections": [s for s in statuses if s == 503],
                  "read-timeout": [s for s in statuses if s == 408]}  # fmt: skip


def refused_documents(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    folder = tmp / "kv"
    with server("--reuse", "prefix", "--max-running", "1", "--max-queue", "2", store=f"file://{folder}") as srv:
        docs = [" ".join(f"Document {d} line {i} says {(i * 31 + d) % 997}." for i in range(40)) for d in range(8)]
        answer = note(httpx.post(srv.url + "/v1/kv/documents", json={"documents": docs}, timeout=120))
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/health").json()["busy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stored = len(DiskStore(folder).keys()) if folder.exists() else 0
    return f"{answer.status_code}; {stored} stored", {"queue-full": [answer.status_code]}


def keys_and_stream_options(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    key = "clé-ключ-鍵"
    with server("--api-key", key) as srv:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        keyed = note(httpx.post(srv.url + "/v1/completions", json=body, timeout=60,
                                headers={"Authorization": f"Bearer {key}".encode()}))  # fmt: skip
        options = note(httpx.post(srv.url + "/v1/completions", json=body | {"stream_options": {"include_usage": True}},
                                  headers={"Authorization": f"Bearer {key}".encode()}, timeout=60))  # fmt: skip
    argv = [sys.executable, "-m", "kvforge.cli", "serve", "--model", "smollm2-135m"]
    empty = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=_env() | {"KVFORGE_API_KEY": ""})
    param = options.json()["error"]["param"] if options.status_code == 400 else "-"
    text = (f"{keyed.status_code}; exit {empty.returncode}, {len(empty.stderr.strip().splitlines())} line; "
            f"{options.status_code} {param}")
    return text, {"bad-body": [options.status_code]}


# ------------------------------------------------------------------------------------------------ the router
def _router(upstream: str, handler: Any) -> Any:
    from fastapi.testclient import TestClient

    from kvforge.reuse import FakeEmbedder
    from kvforge.route import build_normalizer, create_router_app
    from kvforge.store import open_store
    from kvforge.vllm.identity import ServedModel, announce

    store = open_store("memory://")
    announce(store, ServedModel("/m", "M:a:b:float32", 16))
    normalizer = build_normalizer(store, "/m", threshold=0.6, embedder=FakeEmbedder())
    return TestClient(create_router_app(normalizer, upstream, transport=httpx.MockTransport(handler)))


def router_password(tmp: Path) -> str:
    password = "Upstr3am-PW"

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"refused by {request.url}")

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with _router(f"http://admin:{password}@vllm.test", down) as client:
        texts = [client.get("/health").text, client.post("/v1/chat/completions", json=chat).text,
                 client.get("/v1/models").text]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "kvforge.cli", "route", "--upstream",
                           f"http://admin:{password}@127.0.0.1:9", "--upstream-wait", "0", "--store", "memory://"],
                          capture_output=True, text=True, timeout=120, env=_env())  # fmt: skip
    texts.append(proc.stdout + proc.stderr)
    return f"{sum(password in t for t in texts)} of {len(texts)} show the password"


def router_broken_upstream(tmp: Path) -> str:
    from test_route import BrokenStream

    def cut(request: httpx.Request) -> httpx.Response:
        stream = json.loads(request.content).get("stream")
        first = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n' if stream else b'{"choi'
        error = httpx.ReadTimeout("stalled") if stream else httpx.RemoteProtocolError("peer closed")
        return httpx.Response(200, stream=BrokenStream(first, error))

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with _router("http://vllm.test", cut) as client:
        cut_short = client.post("/v1/chat/completions", json=chat).status_code
        events = [e for e in client.post("/v1/chat/completions", json=chat | {"stream": True}).text.split("\n\n") if e]
    error = "error event" if '"upstream_unavailable"' in events[-2] else "no error event"
    return f"{cut_short}; {error}, {events[-1].removeprefix('data: ')}"


# ------------------------------------------------------------------------------------------------ a hostile Redis
def _seed_hostile_redis(url: str, password: str) -> dict[str, int]:
    """Replace every entry of the Redis store at ``url`` by a hostile one, kinds in turn (forged payloads with valid
    checksums, forged metadata), and add names that are not keys; the count of each kind."""
    import redis

    from kvforge.store.redis import RedisStore

    store = RedisStore(url.replace("redis://", f"redis://:{password}@"))
    raw = redis.Redis.from_url(url, password=password)
    payloads = {"huge-shapes": _huge_shapes, "deflate-bomb": _bomb, "basis-path": _basis_path}
    metas = {"3M-chunks": {"chunks": 3_000_000, "bytes": 3_000_000}, "text-chunks": {"chunks": "1"},
             "nonce-path": {"nonce": "../../x"}, "garbage-meta": None}  # fmt: skip
    kinds = [*payloads, *metas]
    counts = dict.fromkeys(kinds, 0)
    for i, key in enumerate(sorted(store.list_keys())):
        kind = kinds[i % len(kinds)]
        if kind in payloads:
            store.write(key, payloads[kind](bytes(store.read(key) or b"")))
        else:
            meta_key = f"{store.prefix}:seg:{key}:meta"
            meta = json.loads(raw.get(meta_key))
            raw.set(meta_key, "{not json" if metas[kind] is None else json.dumps(meta | metas[kind]))
        counts[kind] += 1
    raw.hset(f"{store.prefix}:seg:sizes", mapping={"bad name!": "lots", "../../etc": 5})
    raw.zadd(f"{store.prefix}:seg:lru", {"bad name!": 2.0})
    raw.hset(f"{store.prefix}:blob:sizes", "semantic-v1-rec-../../bad", 5)
    store.close()
    return counts


def hostile_redis_server(tmp: Path) -> tuple[str, dict[str, list[int]]]:
    from store_helpers import redis_server

    pw = "s3cret-redis-pw"
    with redis_server(tmp / "redis", password=pw) as bare:
        url = bare.replace("redis://", f"redis://:{pw}@")
        _, _, clean_peak, clean_log = _serve_prompts(url)
        counts = _seed_hostile_redis(bare, pw)
        statuses, worst, peak, log = _serve_prompts(url)
    firsts, repeats = statuses[0::2], statuses[1::2]
    tracebacks, leaked = log.count("Traceback"), pw in log or pw in clean_log
    ok = (all(s == 200 for s in firsts) and all(r > 0 for r in repeats) and worst <= 0.5
          and peak <= 1.5 * clean_peak and tracebacks == 0 and not leaked and sum(counts.values()) > 0)  # fmt: skip
    text = (
        f"{'ok' if ok else 'FAILED'}: {sum(counts.values())} hostile entries {counts}; "
        f"statuses {sorted(set(firsts))}, repeats hit {sum(r > 0 for r in repeats)}/{len(repeats)}; "
        f"/health worst {worst:.2f} s; peak RSS {peak:.0f} MiB vs clean {clean_peak:.0f} MiB "
        f"({peak / clean_peak:.2f}x); {tracebacks} tracebacks; password {'LEAKED' if leaked else 'in no output'}; "
        f"{log.count('WARNING')} warning lines"
    )
    return text, {"hostile-store": firsts}


CASES = [
    Case("a store whose every entry is hostile (FIFO, link out, 10^9-token shapes, 256 MiB inflation bomb, sparse "
         "2 GiB garbage, basis `../..` path), a shard folder linked out, a bad name; 6 prompts twice on `kvforge "
         "serve`",
         "starts; 200 each, the repeat a hit; /health worst <= 0.5 s; peak RSS <= 1.5x a clean run's; 0 "
         "tracebacks; files outside untouched", hostile_store_server, starts("ok"), promise="hostile-store,no-500"),
    Case("a password-protected redis-server whose every entry is hostile (10^9-token shapes, 256 MiB inflation "
         "bomb, basis `../..` path, 3,000,000 chunks, `chunks: \"1\"`, a nonce path, garbage metadata) plus names "
         "that are not keys; 6 prompts twice on `kvforge serve`",
         "starts; 200 each, the repeat a hit; /health worst <= 0.5 s; peak RSS <= 1.5x a clean run's; 0 "
         "tracebacks; the password in no output", hostile_redis_server, starts("ok"), promise="hostile-store,no-500",
         needs="redis-server"),
    Case("a FIFO at an entry and at a blob of a store folder: `kvforge cache ls`, `cache stats`, `cache clear`",
         "each exits 0 within 60 s; the FIFOs left in place", fifo_commands, equals("0/0/0; fifos kept")),
    Case("forged entries with valid checksums read by a fresh process: 10^9-token shapes (16 KB file), a 256 MiB "
         "inflation bomb, a sparse 2 GiB file with a garbage header", "each a miss, < 64 MiB more memory, < 1 s",
         forged_sizes, starts("ok")),
    Case("links out of a store folder: an entry linked to a file outside, a shard folder (hashed and former "
         "layout) linked to a folder outside; reads, a write, `kvforge cache clear`",
         "misses; the write lands inside; every file outside untouched", links_out,
         equals("3 misses; outside untouched")),
    Case("Redis values written by others (fakeredis): an entry declaring 3,000,000 chunks, `chunks: \"1\"`, a bad "
         "nonce, a name that is not a key in the sizes hash and LRU set, a non-numeric size; then reads, `stats`, "
         "semantic reuse", "each a miss (removed), < 1 s; stats and semantic reuse work; one warning per entry",
         redis_values, starts("ok"), needs="fakeredis"),
    Case("an old-format semantic index blob whose FAISS body is garbage; a record naming `../../x`",
         "semantic reuse starts (the blob ignored with one warning, the record skipped); FAISS never reads the "
         "body", old_index_garbage, starts("ok")),
    Case("3 writer processes sharing one disk store (max_bytes = 8 entries), 60 entries each; disk use sampled "
         "every ms", "peak <= max_bytes", shared_budget,
         lambda o: o.startswith("peak") and float(o.split()[1].rstrip("x")) <= 1.0),
    Case("1,100 connections each sending half a request to `kvforge serve` under `ulimit -n 1024` (--read-timeout 3)",
         "past the cap: 503 at once; the rest 408 within the timeout; /health 200 after; < 20 log lines, 0 "
         "tracebacks", idle_connections, starts("ok"), promise="too-many-connections,read-timeout"),
    Case("a documents request with 8 documents on --max-running 1 --max-queue 2 (refused 429 while its first were "
         "queued)", "429; none of its documents computed or stored afterwards", refused_documents,
         starts("429; 0 stored"), promise="queue-full"),
    Case("a non-ASCII --api-key (UTF-8 header), `KVFORGE_API_KEY=` (empty), `stream_options` without `stream`",
         "200; exit 2 in one line; 400 naming stream_options", keys_and_stream_options,
         equals("200; exit 2, 1 line; 400 stream_options"), promise="bad-body"),
    Case("`kvforge route --upstream http://admin:PW@host`: upstream down (/health, a chat, a passthrough), the "
         "start-up and wait lines", "the password in no body or line", router_password,
         equals("0 of 4 show the password")),
    Case("the router's upstream cuts a body short, then stalls a stream (ReadTimeout)",
         "502 upstream_unavailable; the stream ends with an SSE error event then `data: [DONE]`",
         router_broken_upstream, equals("502; error event, [DONE]")),
]
