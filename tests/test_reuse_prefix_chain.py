"""Prefix block chains on real stores: a block copied from another prompt's chain is a miss from there on (one
warning), blocks are written head first so a file-size limit keeps the reachable head, and entries of the previous
format are clean misses."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from store_helpers import redis_server
from test_reuse_prefix import SRC, full_prefill, ids_of, reuse_prefill

from kvforge.reuse import PrefixReuse
from kvforge.reuse.base import digest, encode_ids
from kvforge.store import MemoryStore, open_store
from kvforge.testing import tiny_model

B = 16
A, OTHER_A, C, T = ids_of(B, seed=31), ids_of(B, seed=32), ids_of(B, seed=33), ids_of(5, seed=34)
X, Y = A + C + T, OTHER_A + C + T  # the same second block (C) after another first block


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("redis")
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


def open_kind(kind: str, tmp_path: Path, request: pytest.FixtureRequest):
    if kind == "memory":
        return MemoryStore()
    if kind == "file":
        return open_store(f"file://{tmp_path}/kv")
    store = open_store(request.getfixturevalue("redis_url"))
    store.clear()
    return store


def copy_entry(store, src: str, dst: str) -> None:
    """Copy the stored bytes of ``src`` over ``dst``: the file itself on a disk store, the raw value elsewhere."""
    if hasattr(store, "path"):
        shutil.copyfile(store.path(src), store.path(dst))
    else:
        store.write(dst, bytes(store.read(src)))


def prefix_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("kvforge")]


@pytest.mark.parametrize("kind", ["memory", "file", pytest.param("redis", marks=pytest.mark.redis)])
@pytest.mark.parametrize("query", ["same prompt", "branch inside the copied block"])
def test_block_copied_from_another_chain_is_a_miss_from_there_on(kind, query, llama, tmp_path, request, caplog):
    store = open_kind(kind, tmp_path, request)
    reuse = PrefixReuse(store, "tiny", block_size=B)
    caches = {}
    for ids in (X, Y):
        caches[len(caches)], _ = full_prefill(llama, ids)
        reuse.record(ids, caches[len(caches) - 1])
    kx, ky = reuse.block_keys(X), reuse.block_keys(Y)
    own = store.get(kx[1])
    copy_entry(store, ky[1], kx[1])
    copied = store.get(kx[1])  # a valid entry: same tokens, same positions, its checksum intact
    assert copied is not None and copied.token_ids == own.token_ids == C
    assert torch.equal(copied.positions[0], own.positions[0])
    assert (copied.keys[-1] - own.keys[-1]).abs().max() > 1e-3  # but other KV: it attended to OTHER_A, not A

    prompt = X if query == "same prompt" else A + C[:8] + ids_of(9, seed=35)
    if kind == "file":
        store = open_store(f"file://{tmp_path}/kv")  # another process's view: nothing cached in memory
    with caplog.at_level(logging.WARNING):
        plan, _, logits = reuse_prefill(llama, PrefixReuse(store, "tiny", block_size=B), prompt)
    assert plan.reused_tokens == B  # the copied block and everything after it are a miss
    (warning,) = prefix_warnings(caplog)
    assert f"[{B}, {2 * B})" in warning and "another chain" in warning
    _, ref = full_prefill(llama, prompt)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)

    # the wrong block was removed: X's own block is stored again by the next record, and X is a full hit
    assert not store.contains(kx[1])
    reuse = PrefixReuse(store, "tiny", block_size=B)
    reuse.record(X, caches[0])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        plan, _, logits = reuse_prefill(llama, reuse, X)
    assert plan.reused_tokens == len(X) - 1 and not prefix_warnings(caplog)
    _, ref = full_prefill(llama, X)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_header_carries_the_chain(llama):
    store = MemoryStore()
    reuse = PrefixReuse(store, "tiny", block_size=B)
    cache, _ = full_prefill(llama, X)
    reuse.record(X, cache)
    chains = reuse.block_chains(X)
    for i, key in enumerate(reuse.block_keys(X)):
        meta = store.get(key).meta
        assert key.endswith(chains[i]) and meta["chain"] == chains[i]
        assert meta["parent"] == (chains[i - 1] if i else reuse.root)
    assert reuse.block_chains(Y)[1] != chains[1]  # same tokens, other chain


def v1_keys(ids: list[int], model_id: str, block_size: int) -> list[str]:
    """The keys the previous prefix format used (no chain hash in the header)."""
    keys, parent = [], digest("kvforge-prefix-v1", model_id, str(block_size))
    for s in range(0, len(ids), block_size):
        parent = digest(parent, encode_ids(ids[s : s + block_size]))
        keys.append("prefix-v1-" + parent)
    return keys


def test_entries_of_the_previous_format_are_a_clean_miss(llama, tmp_path, caplog):
    store = open_store(f"file://{tmp_path}/kv")
    cache, _ = full_prefill(llama, X)
    old = v1_keys(X, "tiny", B)
    for i, key in enumerate(old):  # what the previous writer stored
        start, end = i * B, min((i + 1) * B, len(X))
        seg = cache.to_segment("tiny", X[start:end], start=start, end=end)
        seg.meta = {"layer_windows": [None, None], "block_start": start, "format": "prefix-v1-"}
        store.put(key, seg)
    reuse = PrefixReuse(open_store(f"file://{tmp_path}/kv"), "tiny", block_size=B)
    with caplog.at_level(logging.WARNING):
        plan = reuse.plan(X)
    assert plan.kind == "miss" and plan.reused_tokens == 0 and not prefix_warnings(caplog)
    # a block of the previous format under a current key (copied by hand): refused, with one warning
    new = store.path(reuse.block_keys(X)[0])
    new.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(store.path(old[0]), new)
    with caplog.at_level(logging.WARNING):
        plan = reuse.plan(X)
    assert plan.kind == "miss" and len(prefix_warnings(caplog)) == 1 and "format" in prefix_warnings(caplog)[0]
    # and the prompt is stored again in the current format
    reuse.record(X, cache)
    assert reuse.plan(X).reused_tokens == len(X) - 1


# ------------------------------------------------------------------------------------------------ write order
RECORD_UNDER_LIMIT = textwrap.dedent(
    """
    import json, resource, sys
    from kvforge.prefill import prefill
    from kvforge.cache import KVCache
    from kvforge.reuse import PrefixReuse
    from kvforge.store import open_store
    from kvforge.testing import tiny_model

    url, limit, ids = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    model = tiny_model("llama")
    cache = KVCache.for_model(model)
    prefill(model, ids, cache)
    store = open_store(url)
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # the kernel refuses any file past it (EFBIG)
    PrefixReuse(store, "tiny", block_size=16).record(ids, cache)
    print(json.dumps(sorted(store.keys())))
    """
)


def record_in_child(url: str, ids: list[int], limit: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run(
        [sys.executable, "-c", RECORD_UNDER_LIMIT, url, str(limit), str(ids)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE semantics checked on Linux")
def test_file_size_limit_keeps_the_reachable_head(llama, tmp_path):
    """A real file-size limit (RLIMIT_FSIZE, as ``ulimit -f``) that the first block fits under and the second does
    not: the first block is stored, the chain stops at the failed one (the later, smaller blocks that would fit are
    not written: they would be unreachable), and the same prompt then hits the stored head."""
    small, large = [3 + i % 7 for i in range(B)], [10 + (i * 7) % 89 for i in range(2 * B)]
    ids = small + large + [50, 60, 70]  # block 0's header names one-digit tokens, block 1's two-digit ones
    sizing = MemoryStore()  # the bytes a disk store writes for each block (memory keeps them encoded alike)
    reuse = PrefixReuse(sizing, "tiny", block_size=B)
    cache, ref = full_prefill(llama, ids)
    reuse.record(ids, cache)
    sizes = [sizing.stored_size(k) for k in reuse.block_keys(ids)]
    limit = sizes[0]
    assert sizes[1] > limit and sizes[2] <= limit and sizes[3] <= limit, sizes  # later blocks would fit

    url = f"file://{tmp_path}/kv"
    out = record_in_child(url, ids, limit)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f'["{reuse.block_keys(ids)[0]}"]']  # only the head, no unreachable block
    warnings = [line for line in out.stderr.splitlines() if "not stored" in line]
    assert len(warnings) == 1 and "File too large" in warnings[0], out.stderr
    assert not list((tmp_path / "kv" / "tmp").iterdir())  # the failed write left no partial file

    reopened = PrefixReuse(open_store(url), "tiny", block_size=B)
    plan, _, logits = reuse_prefill(llama, reopened, ids)
    assert plan.reused_tokens == B  # the head is hit
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    out = record_in_child(url, ids, 0)  # without the limit the rest of the chain is stored
    assert out.returncode == 0, out.stderr
    assert reopened.plan(ids).reused_tokens == len(ids) - 1


def test_a_store_that_skips_a_write_stops_the_chain(llama, caplog):
    """A store that refuses a block without raising (over its byte bound, a full disk it reports itself): nothing
    after that block is written."""
    ids = ids_of(3 * B + 4, seed=36)
    cache, _ = full_prefill(llama, ids)
    probe = MemoryStore()
    PrefixReuse(probe, "tiny", block_size=B).record(ids, cache)
    block = max(probe.stored_size(k) for k in probe.list_keys())

    class FillingStore(MemoryStore):
        """Takes two blocks, then skips every write (as a disk store does once its disk is full)."""

        def write(self, key, data, kind="seg"):
            if kind == "seg" and len(self.keys()) >= 2:
                return
            super().write(key, data, kind)

    store = FillingStore(max_bytes=100 * block)
    reuse = PrefixReuse(store, "tiny", block_size=B)
    reuse.record(ids, cache)
    keys = reuse.block_keys(ids)
    assert sorted(store.keys()) == sorted(keys[:2])
    assert reuse.plan(ids).reused_tokens == 2 * B


FILL_A_DISK = textwrap.dedent(
    """
    import json, sys
    from kvforge.cache import KVCache
    from kvforge.prefill import prefill
    from kvforge.reuse import PrefixReuse
    from kvforge.store import open_store
    from kvforge.testing import tiny_model

    url, ids = sys.argv[1], json.loads(sys.argv[2])
    model = tiny_model("llama")
    cache = KVCache.for_model(model)
    prefill(model, ids, cache)
    store = open_store(url)
    PrefixReuse(store, "tiny", block_size=16).record(ids, cache)
    plan = PrefixReuse(open_store(url), "tiny", block_size=16).plan(ids)
    print(json.dumps({"keys": sorted(store.keys()), "reused": plan.reused_tokens}))
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) for a private tmpfs")
def test_full_disk_keeps_the_reachable_head(llama, tmp_path):
    """A real filesystem that fills mid-chain (a small tmpfs in a private mount namespace, ENOSPC from the kernel):
    the blocks that fit are the head of the chain, nothing after the first refused block is kept, and the same
    prompt hits the stored head."""
    ids = ids_of(6 * B + 3, seed=37)
    sizing = MemoryStore()
    reuse = PrefixReuse(sizing, "tiny", block_size=B)
    cache, _ = full_prefill(llama, ids)
    reuse.record(ids, cache)
    pages = [-(-sizing.stored_size(k) // 4096) for k in reuse.block_keys(ids)]
    mount = tmp_path / "disk"
    mount.mkdir()
    size = 4096 * (pages[0] + pages[1] + 1)  # two blocks fit, the third does not
    script = f'mount -t tmpfs -o size={size} tmpfs {mount} && exec {sys.executable} -c "$0" "$1" "$2"'
    out = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, FILL_A_DISK, f"file://{mount}/kv",
         str(ids)],
        env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if out.returncode != 0 and ("unshare" in out.stderr or "mount" in out.stderr) and "Traceback" not in out.stderr:
        pytest.skip(f"no private tmpfs here: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["keys"] == sorted(reuse.block_keys(ids)[:2])
    assert result["reused"] == 2 * B
    assert "no space left" in out.stderr.lower(), out.stderr


def test_tiered_store_sees_children_listed_by_another_process(llama, tmp_path):
    """Two processes on memory+disk tiers: what one lists on disk after the other cached the list in its memory tier
    is still found (the tiers' lists are merged)."""
    url = f"memory://,file://{tmp_path}/kv"
    a, b = (PrefixReuse(open_store(url), "tiny", block_size=B) for _ in range(2))
    doc = ids_of(2 * B + 5, seed=70)
    q1, q3 = [4, *ids_of(9, seed=71)], [5, 6, 7, 8, *ids_of(6, seed=72)]
    for reuse, ids in ((a, doc), (a, doc + q1), (b, doc + q3)):
        reuse.plan(ids)  # a reads (and caches) the list before b adds to it
        cache, _ = full_prefill(llama, ids)
        reuse.record(ids, cache)
    query = doc + q3[:3] + [9, 9, 9]
    plan, _, logits = reuse_prefill(llama, a, query)  # a's memory tier lists only q1's block
    assert plan.reused_tokens == len(doc) + 3
    _, ref = full_prefill(llama, query)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
