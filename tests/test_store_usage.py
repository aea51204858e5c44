"""Every store's ``usage()`` reports the same keys, counted from what it holds."""

from __future__ import annotations

import pytest

from kvforge.store.disk import DiskStore
from kvforge.store.memory import MemoryStore


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_usage_counts_entries_bytes_and_blobs(kind, tmp_path):
    store = MemoryStore(max_bytes=10_000) if kind == "memory" else DiskStore(tmp_path, max_bytes=10_000)
    store.write("a" * 64, b"x" * 100)
    store.write("b" * 64, b"y" * 50)
    store.write("c" * 64, b"z" * 30, kind="blob")
    usage = store.usage()
    assert usage["url"].startswith(f"{kind}://") and "max_bytes=10000" in usage["url"]
    assert (usage["entries"], usage["capacity"], usage["blobs"], usage["blob_bytes"]) == (2, 10_000, 1, 30)
    assert usage["bytes"] >= 150
    if kind == "file":
        assert (usage["tmp_files"], usage["tmp_bytes"]) == (0, 0)
