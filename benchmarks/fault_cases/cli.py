"""Command-line cases: each a real ``kvforge`` process (or ``cli.main``), its exit code and what it printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

from os_faults import python_env
from store_helpers import free_port, redis_server

from fault_cases import Case, equals, starts, tiny_model_dir

PASSWORDS = ["Qa#sXZJK", "Qa?sXZJK", "Qa/sXZJK", "Qa,sXZJK", "Qa@sXZJK", "Qz#?/,@Xk9J"]  # letters no message spells


def _kvforge(*args: str, wrap: object = None, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kvforge.cli", *args]
    return subprocess.run(wrap(argv) if callable(wrap) else argv, capture_output=True, text=True, timeout=300,
                          env=python_env() | (env or {}))  # fmt: skip


def _one_line(proc: subprocess.CompletedProcess) -> str:
    err = proc.stderr
    return f"rc {proc.returncode}/{err.count(chr(10))} line/{'traceback' if 'Traceback' in err else 'no traceback'}"


def config_types(tmp: Path) -> str:
    out = ""
    for text in ("store = 5", "store = true", "[generate]\nmax-new-tokens = [3]"):
        config = tmp / "kvforge.toml"
        config.write_text(text + "\n")
        out += _one_line(_kvforge("--config", str(config), "cache", "ls"))
    return out


def redis_client_options(tmp: Path) -> str:
    out = ""
    pw = "Qz#?/,@Xk9J"
    with redis_server(tmp / "redis", password=pw) as bare:
        host = bare.removeprefix("redis://").removesuffix("/0")
        auth = f"{quote(pw, safe='')}@{host}"
        for url in (f"redis://:{auth}/0?ssl_cert_reqs=required", f"redis://:{auth}/0?ssl_keyfile=/etc/hostname",
                    f"rediss://:{auth}/0?ssl_keyfile=/no/such.key&ssl_certfile=/no/such.crt",
                    f"redis://:{auth}/0?socket_timout=3"):  # fmt: skip
            proc = _kvforge("cache", "stats", "--store", url)
            hidden = pw[:4] not in proc.stderr + proc.stdout and quote(pw, safe="")[:6] not in proc.stderr
            out += _one_line(proc) + ("/hidden" if hidden else "/SHOWN")
    return out


def generate_read_only(tmp: Path) -> str:
    from os_faults import read_only

    folder = tmp / "kv"
    folder.mkdir()
    args = ("generate", "--model", str(tiny_model_dir()), "--device", "cpu", "--reuse", "prefix", "--store",
            f"file://{folder}", "--prompt", "Where is the key? " * 20, "--max-new-tokens", "4")  # fmt: skip
    proc = _kvforge(*args, wrap=lambda argv: read_only(folder, argv))
    warned = sum("write of" in line for line in proc.stderr.splitlines())
    return (f"rc {proc.returncode}/{'answered' if proc.stdout.strip() else 'no answer'}/{warned} warning"
            f"/{'traceback' if 'Traceback' in proc.stderr else 'no traceback'}")  # fmt: skip


def passwords_in_cli_output(tmp: Path) -> str:
    from kvforge.redact import redact_argv

    port = free_port()
    leaks, checked = 0, 0
    for pw in PASSWORDS:
        forms = [f"redis://:{pw}@127.0.0.1:{port}/0", f"redis://:{quote(pw, safe='')}@127.0.0.1:{port}/0",
                 f"redis://127.0.0.1:{port}/0?password={quote(pw)}", f"redis://127.0.0.1:{port}/0?PASSWORD={pw}",
                 f"memory://,redis://:{pw}@127.0.0.1:{port}/0"]  # fmt: skip
        for url in forms:
            texts = []
            for args in (("-v", "cache", "stats", "--store", url), ("cache", "clear", "--store", url)):
                proc = _kvforge(*args)
                texts.append(proc.stdout + proc.stderr)
            texts.append(_kvforge("cache", "ls", "--help", env={"KVFORGE_STORE": url}).stdout)
            texts.append(redact_argv(["eval", "--store", url, "--task", "needle"]))
            template = url.replace(pw, "").replace(quote(pw, safe=""), "").replace(quote(pw), "")
            for text in texts:
                checked += 1
                leaks += any(pw[i : i + 4] in text and pw[i : i + 4] not in template for i in range(len(pw) - 3))
    return f"{leaks} of {checked} outputs leak"


CASES = [
    Case("a config file with `store = 5`, `store = true`, `max-new-tokens = [3]`",
         "rc 2, one line, no traceback (each)", config_types, equals("rc 2/1 line/no traceback" * 3)),
    Case("redis://...?ssl_cert_reqs=required, ?ssl_keyfile=..., rediss:// with a missing key file, "
         "?socket_timout= (password-protected redis-server)", "rc 2, one line, no traceback, no password (each)",
         redis_client_options, equals("rc 2/1 line/no traceback/hidden" * 4), needs="redis-server"),
    Case("`kvforge generate --reuse prefix` on a store mounted read-only", "rc 0, an answer, one warning, no traceback",
         generate_read_only, equals("rc 0/answered/1 warning/no traceback"), needs="namespaces"),
    Case("passwords holding # ? / , @ (userinfo raw and encoded, ?password=, ?PASSWORD=, a tier list): CLI "
         "errors, logs (-v), --help, eval provenance", "0 outputs show any 4 characters of a password",
         passwords_in_cli_output, starts("0 of "), promise="no-secret"),
]
