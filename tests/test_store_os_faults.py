"""Store faults the kernel enforces (a read-only bind mount, a full tmpfs, ``ulimit -f``), in child processes: hits are
still served, every write is skipped with ONE warning per cause, nothing raises, ``cache clear`` says what it could not
delete, and read-only commands create no folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from os_faults import file_size_limit, full_disk, namespaces_or_skip, python_env, read_only
from store_helpers import make_segment

from kvforge.cli import main
from kvforge.store import DiskStore

# In the faulted child: a hit, 3 new entries, a blob, a delete, a clear; one JSON line of what happened.
CHILD = r"""
import json, logging, sys
from store_helpers import make_segment
from kvforge.store import open_store
from kvforge.store.codec import segments_equal

logging.basicConfig(level=logging.WARNING, format="WARNING %(message)s")
store = open_store(sys.argv[1])
out = {"hit": segments_equal(store.get("aa"), make_segment())}
for i in range(3):
    store.put(f"new{i}", make_segment(seed=i, lengths=(64, 64), head_dim=16))
store.put_blob("index", b"x" * 10_000)
out["new_stored"] = [store.contains(f"new{i}") for i in range(3)]
store.delete("aa")
out["after_delete"] = store.contains("aa")
result = store.clear()
out["cleared"], out["not_cleared"] = result.removed, sorted(set(result.failed.values()))
out["small_stored"] = None
if len(sys.argv) > 2:  # below the file-size limit: a write succeeds again
    store.put("small", make_segment(lengths=(1,), head_dim=2, num_heads=1))
    out["small_stored"] = store.contains("small")
print(json.dumps(out))
"""


def _populated(folder: Path) -> str:
    url = f"file://{folder}?fsync=0"
    DiskStore(folder, fsync=False).put("aa", make_segment())
    return url


def _run(argv: list[str], **kwargs) -> tuple[dict, str]:  # type: ignore[no-untyped-def]
    proc = subprocess.run(argv, capture_output=True, text=True, env=python_env(), timeout=120, **kwargs)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _warnings(stderr: str, text: str) -> int:
    return sum(text in line for line in stderr.splitlines() if line.startswith("WARNING"))


def test_read_only_mount(tmp_path: Path) -> None:
    namespaces_or_skip()
    url = _populated(tmp_path / "kv")
    out, err = _run(read_only(tmp_path / "kv", [sys.executable, "-c", CHILD, url]))
    assert out["hit"] and out["new_stored"] == [False] * 3 and out["after_delete"]
    assert out["cleared"] == 0 and out["not_cleared"] == ["Read-only file system [EROFS]"]
    assert _warnings(err, "write of") == 1 and _warnings(err, "[EROFS]") == 2  # one per cause: write, remove
    assert not (tmp_path / "kv" / "tmp").exists() or not list((tmp_path / "kv" / "tmp").iterdir())


def test_full_disk(tmp_path: Path) -> None:
    namespaces_or_skip()
    url = _populated(tmp_path / "kv")
    out, err = _run(full_disk(tmp_path / "kv", [sys.executable, "-c", CHILD, url]))
    assert out["hit"] and out["new_stored"] == [False] * 3
    assert _warnings(err, "write of") == 1 and "No space left on device [ENOSPC]" in err
    assert not out["after_delete"] and out["not_cleared"] == []  # a full disk still deletes


def test_file_size_limit(tmp_path: Path) -> None:
    """``ulimit -f``: EFBIG, handled by the same rule as every other OSError (no errno list)."""
    url = _populated(tmp_path / "kv")
    limit = file_size_limit(4096)
    out, err = _run([sys.executable, "-c", CHILD, url, "small"], preexec_fn=limit)
    assert out["hit"] and out["new_stored"] == [False] * 3 and out["small_stored"] is True
    assert _warnings(err, "File too large [EFBIG]") == 1 and "writes succeed again" in err


def test_cache_clear_on_a_read_only_mount_says_what_it_could_not_delete(tmp_path: Path) -> None:
    namespaces_or_skip()
    folder = tmp_path / "kv"
    store = DiskStore(folder, fsync=False)
    for i in range(4):
        store.put(f"k{i}", make_segment(seed=i))
    cli = [sys.executable, "-m", "kvforge.cli", "cache", "clear", "--store", f"file://{folder}"]
    proc = subprocess.run(read_only(folder, cli), capture_output=True, text=True, env=python_env(), timeout=120)
    assert proc.returncode == 1 and "cleared 0 entries" in proc.stdout
    assert proc.stderr.count("\n") == 1 and "could not delete 4 entries" in proc.stderr
    assert "Read-only file system [EROFS]: 4" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(DiskStore(folder).keys()) == [f"k{i}" for i in range(4)]


@pytest.mark.parametrize("command", [["ls"], ["ls", "--json"], ["stats"], ["stats", "--fast"]])
def test_read_only_commands_create_no_folder(tmp_path: Path, command: list[str], capsys) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "no" / "such" / "store"
    assert main(["cache", *command, "--store", f"file://{folder}"]) == 0
    capsys.readouterr()
    assert not (tmp_path / "no").exists()


def test_a_failed_write_reports_its_own_error_once_and_its_cleanup_never_raises(tmp_path: Path) -> None:
    """EROFS when the tmp file is created, then again when the cleanup unlinks it: the backend raises the first
    error only (the rule above it makes that a skipped write)."""
    namespaces_or_skip()
    from kvforge.store.disk import shard

    folder = tmp_path / "kv"
    for sub in ("tmp", f"segments/{shard('zz')}"):
        (folder / sub).mkdir(parents=True)
    child = "import sys\nfrom kvforge.store import DiskStore\nDiskStore(sys.argv[1]).write_parts('zz', [b'x'])\n"
    proc = subprocess.run(read_only(folder, [sys.executable, "-c", child, str(folder)]), capture_output=True,
                          text=True, env=python_env(), timeout=60)  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.count("[Errno 30] Read-only file system") == 1, proc.stderr
    assert "During handling" not in proc.stderr and list((folder / "tmp").iterdir()) == []
