"""What the benchmark scripts share: where result rows go (one ``results/`` folder at the repository's root, one
sub-folder per topic), a server subprocess (``kvforge serve``, vLLM, ``kvforge route``) and its CPU time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def append_rows(path: str | Path, rows: list[dict[str, Any]] | dict[str, Any]) -> None:
    """Append JSON lines (one row or a list) to ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in [rows] if isinstance(rows, dict) else rows:
            f.write(json.dumps(row) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads (Linux ``/proc``; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    """A server subprocess: its command, port, log file; ``start`` returns at once, ``wait`` until it answers."""

    name: str
    command: list[str]
    port: int
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{self.name}.log", "ab")  # noqa: SIM115 (closed with the process)
        env = os.environ | {"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"} | self.env
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)  # fmt: skip
        self.started_at = time.monotonic()
        return self

    def wait(self, timeout_s: float = 900.0, path: str = "/health") -> Server:
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}; see {self.log_dir}/{self.name}.log"
                )
            try:
                if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                    self.ready_s = time.monotonic() - self.started_at
                    print(f"[bench] {self.name} ready in {self.ready_s:.0f} s on {self.url}", file=sys.stderr)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2.0)
        raise TimeoutError(f"{self.name} did not answer {path} within {timeout_s:.0f} s")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM (vLLM then shuts its connector down, flushing pending block writes), SIGKILL after ``grace_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
