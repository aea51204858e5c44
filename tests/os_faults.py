"""Faults the operating system enforces, for tests and ``benchmarks/faults.py``: a read-only bind mount, a full tmpfs,
a file-size limit (``ulimit -f``). Nothing is simulated: the kernel refuses the writes.

The mounts are made in a private mount namespace (``unshare -m``, or ``unshare -rm`` for a user that is not root), so
only the faulted command sees them and nothing is left mounted if a test dies. Where the kernel allows no namespace,
:func:`namespaces_or_skip` skips with a one-line reason.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent


def _unshare() -> list[str] | None:
    exe = shutil.which("unshare")
    if exe is None:
        return None
    for flags in (["-m"], ["-rm"]) if os.geteuid() == 0 else (["-rm"],):
        probe = subprocess.run([exe, *flags, "true"], capture_output=True)
        if probe.returncode == 0:
            return [exe, *flags]
    return None


def why_no_namespaces() -> str | None:
    """None when faults can be mounted here, else why not (one line)."""
    if _unshare() is None:
        return "no private mount namespace here (unshare missing, or user namespaces disabled): OS fault tests skipped"
    return None


def namespaces_or_skip() -> None:
    reason = why_no_namespaces()
    if reason is not None:
        import pytest

        pytest.skip(reason)


def read_only(folder: Path, argv: list[str], trigger: Path | None = None) -> list[str]:
    """``argv`` run with ``folder`` (and all below it) mounted read-only (EROFS on every write); with ``trigger``, the
    folder stays writable until that file appears (then ``<trigger>.done`` is made once the mount is read-only)."""
    f = shlex.quote(str(folder))
    return _faulted(f"mount --bind {f} {f}", f"mount -o remount,ro,bind {f}", argv, trigger)


def full_disk(
    folder: Path, argv: list[str], size: str = "2m", trigger: Path | None = None, fill: bool = True
) -> list[str]:
    """``argv`` run with ``folder`` on a tmpfs of ``size`` that holds a copy of ``folder``'s files and is filled to
    the last byte (ENOSPC on every write that needs a block); with ``trigger``, filled when that file appears; with
    ``fill=False``, never filled: the disk is just ``size`` bytes."""
    f = shlex.quote(str(folder))
    stage = shlex.quote(str(folder) + ".stage")
    setup = f"rm -rf {stage} && cp -a {f} {stage} && mount -t tmpfs -o size={size} tmpfs {f} && cp -a {stage}/. {f}/"
    filler = f"{{ dd if=/dev/zero of={f}/.fill bs=4k 2>/dev/null; dd if=/dev/zero of={f}/.fill2 bs=1 2>/dev/null; }}"
    return _faulted(setup, filler if fill else "true", argv, trigger)


def _faulted(setup: str, fault: str, argv: list[str], trigger: Path | None) -> list[str]:
    if trigger is None:
        script = f"{setup} && {{ {fault}; true; }} && exec \"$@\""
    else:  # run the command now, fault its folder later; SIGTERM/SIGINT reach the command
        t = shlex.quote(str(trigger))
        script = (
            f"{setup} || exit 97; \"$@\" & pid=$!; trap 'kill -TERM $pid' TERM; trap 'kill -INT $pid' INT; "
            f"while [ ! -e {t} ] && kill -0 $pid 2>/dev/null; do sleep 0.05; done; "
            f"if [ -e {t} ]; then {fault}; touch {t}.done; fi; wait $pid; rc=$?; "
            f"while kill -0 $pid 2>/dev/null; do wait $pid; rc=$?; done; exit $rc"
        )
    return [*(_unshare() or []), "sh", "-c", script, "sh", *argv]


def file_size_limit(num_bytes: int):  # type: ignore[no-untyped-def]
    """A ``preexec_fn`` that sets ``ulimit -f`` (RLIMIT_FSIZE) in the child: a write past it fails with EFBIG
    (Python ignores SIGXFSZ, so the write returns the error instead of killing the process)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, num_bytes))

    return limit


def python_env() -> dict[str, str]:
    """The environment of a child Python that imports this checkout's kvforge and the tests' helpers."""
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")])}
