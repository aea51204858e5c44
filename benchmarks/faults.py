"""Fault matrix: each case provoked for real, and what happened compared with what must happen.

    python benchmarks/faults.py [--only TEXT] [--out results/serve/faults.jsonl]

Real processes throughout: ``kvforge serve`` children driven over HTTP, ``kvforge`` commands, writer processes killed
with SIGKILL, a real (password-protected) redis-server, and faults the kernel enforces — a read-only bind mount and a
filled tmpfs (in a private mount namespace: ``unshare``), ``ulimit -f`` (RLIMIT_FSIZE). A case tied to the server's
promise list (docs/serve.md, "What the server promises") passes only if every answer has the promised status, and a
last row checks that every promise there is exercised by some case.

Prints one JSON line per case (case, expected, observed, ok) and a markdown table; exits 1 if a case fails. Cases that
need redis-server or mount namespaces are reported as skipped, with the reason, where those are missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers (OS faults, redis-server)
from common import RESULTS
from fault_cases import Case, cli, hostile, promised_status, promises, serve, store
from os_faults import why_no_namespaces

CASES = [*cli.CASES, *serve.CASES, *hostile.CASES, *store.CASES]  # serve's no-500 row sums the server rows before it


def _skip_reason(c: Case) -> str | None:
    if c.needs == "redis-server" and shutil.which("redis-server") is None:
        return "skipped: redis-server not on PATH"
    if c.needs == "namespaces":
        return why_no_namespaces()
    if c.needs == "fakeredis" and not all(importlib.util.find_spec(m) for m in ("fakeredis", "lupa")):
        return "skipped: fakeredis with Lua (pip install 'fakeredis[lua]') not installed"
    return None


def _run(c: Case, promised: dict[str, str]) -> dict[str, Any]:
    """Run one case in a fresh temporary folder; its row."""
    tmp = Path(tempfile.mkdtemp(prefix="kvforge-faults-"))
    start = time.monotonic()
    try:
        reason = _skip_reason(c)
        if reason is not None:
            return {"case": c.name, "expected": c.expected, "observed": reason, "ok": None}
        result = c.run(tmp)
        observed, statuses = (result, {}) if isinstance(result, str) else result
        passed = c.ok(observed) if c.ok is not None else True
        for promise, got in statuses.items():
            want = promised_status(promised.get(promise, ""))
            if promise not in promised:
                observed += f"; promise {promise!r} is not in docs/serve.md"
                passed = False
            elif want is not None and any(s != want for s in got):
                observed += f"; {promise}: got {got}, promised {want}"
                passed = False
    except Exception as e:  # a fault case that crashes is a failed case, reported as such
        observed, passed = f"crashed: {type(e).__name__}: {str(e)[:300]}", False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"case": c.name, "expected": c.expected, "observed": observed, "ok": passed,
            "promise": c.promise, "seconds": round(time.monotonic() - start, 1)}  # fmt: skip


def _coverage(promised: dict[str, str]) -> dict[str, Any]:
    covered = {p for c in CASES if c.promise for p in c.promise.split(",")}
    missing = sorted(set(promised) - covered)
    return {
        "case": "every promise of docs/serve.md is exercised by a case",
        "expected": f"{len(promised)} of {len(promised)}",
        "observed": f"{len(promised) - len(missing)} of {len(promised)}" + (f", missing {missing}" if missing else ""),
        "ok": not missing,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "serve" / "faults.jsonl")
    ap.add_argument("--only", action="append", default=None,
                    help="run only the cases whose name contains this text (repeatable: any of them)")  # fmt: skip
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    promised = promises()
    rows = []
    for c in CASES:
        if args.only is not None and not any(text in c.name for text in args.only):
            continue
        rows.append(_run(c, promised))
        print(json.dumps(rows[-1]), flush=True)
    if args.only is None:
        rows.append(_coverage(promised))
        print(json.dumps(rows[-1]), flush=True)
    from kvforge.provenance import git_sha

    with args.out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row | {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "git_sha": git_sha()}) + "\n")
    print("\n| case | expected | observed | ok |\n|---|---|---|---|")
    for r in rows:
        verdict = "yes" if r["ok"] else "skipped" if r["ok"] is None else "NO"
        cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
        print(f"| {cell(r['case'])} | {cell(r['expected'])} | {cell(r['observed'])} | {verdict} |")
    failed = [r for r in rows if r["ok"] is False]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} held ({sum(r['ok'] is None for r in rows)} skipped)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
