"""Secrets in store URLs never reach any output: the URL is read as redis-py's ``from_url`` reads it, whatever
characters the password holds, in userinfo or in ``?password=``, percent-encoded or not; fuzzed over many passwords
through the redaction itself, store errors, the CLI, logs and ``--help``."""

from __future__ import annotations

import logging
import random
from urllib.parse import quote

import pytest
from store_helpers import free_port

from kvforge.cli import main
from kvforge.errors import UserError
from kvforge.redact import redact_argv, redact_text, redact_url, split_urls
from kvforge.store import open_store

PORT = free_port()  # nothing listens there: every Redis store in these tests is down
HOST = f"127.0.0.1:{PORT}"


def url_forms(pw: str) -> list[str]:
    """Every way a password reaches a store URL."""
    return [
        f"redis://:{pw}@{HOST}/0",
        f"redis://default:{pw}@{HOST}/0",
        f"redis://{pw}@{HOST}/0",  # a lone userinfo: redis-py reads it as a user name, many mean a password
        f"redis://:{quote(pw, safe='')}@{HOST}/0",
        f"rediss://:{pw}@{HOST}/0?ssl_cert_reqs=none",
        f"redis://{HOST}/0?password={pw}",
        f"redis://{HOST}/0?PASSWORD={pw}",
        f"redis://{HOST}/0?password={quote(pw, safe='')}&prefix=kv",
        f"memory://,redis://:{pw}@{HOST}/0",
    ]


def leaked(pw: str, url: str, text: str) -> str | None:
    """A piece of the password (4+ characters, in any encoding) found in ``text`` that is not already part of the
    URL without its password."""
    template = url.replace(pw, "").replace(quote(pw, safe=""), "")
    for form in {pw, quote(pw, safe=""), quote(pw)}:
        for n in range(min(4, len(form)), len(form) + 1):
            for i in range(len(form) - n + 1):
                piece = form[i : i + n]
                if piece in text and piece not in template and piece not in "***":
                    return piece
    return None


ISSUE_PASSWORDS = ["pa#ss1234", "pa?ss1234", "pa/ss1234", "pa,ss1234", "pa@ss1234", "Qz#?/,@Xk9J"]
# letters that no message spells, so a leak is never a false alarm; every character URLs treat specially
_ALPHABET = "QXZJKVWqxzjk2357" + "#?/,@:%=+!$*~-_.[]&;' "


def _fuzz_passwords(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(6, 20)))
        + rng.choice("#?/,@")  # at least one of the characters URLs cut at
        + "".join(rng.choice("QXZJKVW") for _ in range(4))
        for _ in range(n)
    ]


def _messages(url: str) -> str:
    """What opening ``url`` says (it fails: nothing listens), and what it logs."""
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    kv = logging.getLogger("kvforge")
    kv.addHandler(handler)
    level = kv.level
    kv.setLevel(logging.DEBUG)
    try:
        try:
            store = open_store(url)
            store.put("k", b"")  # type: ignore[arg-type]  # never reached for a single down Redis
            text = repr(store) + str(store.stats())
        except UserError as e:
            text = str(e)
        except Exception as e:  # a tiered store opens; its Redis tier is down (a warning), its memory tier answers
            text = f"{type(e).__name__}: {e}"
    finally:
        kv.removeHandler(handler)
        kv.setLevel(level)
    return text + "\n".join(records)


@pytest.mark.parametrize("pw", ISSUE_PASSWORDS)
def test_issue_passwords_never_appear(pw: str) -> None:
    for url in url_forms(pw):
        shown = redact_url(url)
        assert leaked(pw, url, shown) is None, (url, shown)
        assert "***" in shown, (url, shown)
        said = _messages(url)
        assert leaked(pw, url, said) is None, (url, said)
        assert "Traceback" not in said


def test_fuzzed_passwords_never_appear() -> None:
    passwords = _fuzz_passwords(200)
    for pw in passwords:
        for url in url_forms(pw):
            shown = redact_url(url)
            assert leaked(pw, url, shown) is None, (url, shown)
            if " " not in pw:  # in free text a URL ends at a space: kvforge redacts its own URLs before writing them
                assert leaked(pw, url, redact_text(f"error while using {url} (more)")) is None, url
    for pw in passwords[:40]:
        for url in url_forms(pw):
            said = _messages(url)
            assert leaked(pw, url, said) is None, (url, said)


def test_fuzzed_passwords_never_appear_in_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    for pw in _fuzz_passwords(15, seed=1) + ISSUE_PASSWORDS:
        for url in url_forms(pw):
            for command in (["cache", "stats", "--store", url], ["cache", "clear", "--store", url]):
                rc = main(command)
                out, err = capsys.readouterr()
                assert rc != 0 or url.startswith("memory://"), (url, out, err)
                assert leaked(pw, url, out + err) is None, (url, out, err)
                assert "Traceback" not in err and err.count("\n") <= 2, err


def test_password_in_the_default_store_never_shows_in_help(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    for pw in ISSUE_PASSWORDS:
        monkeypatch.setenv("KVFORGE_STORE", f"redis://:{pw}@{HOST}/0")
        for command in (["cache", "ls", "--help"], ["serve", "--help"], ["generate", "--help"]):
            assert main(command) == 0
            assert leaked(pw, "", capsys.readouterr().out) is None


def test_a_comma_in_a_password_stays_in_its_url() -> None:
    url = f"memory://,redis://:pa,ss@{HOST}/0,file:///tmp/kv"
    assert split_urls(url) == ["memory://", f"redis://:pa,ss@{HOST}/0", "file:///tmp/kv"]
    assert redact_url(url) == f"memory://,redis://***@{HOST}/0,file:///tmp/kv"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://:pa#ss@{HOST}/0", f"redis://***@{HOST}/0"),
        (f"redis://:pa/ss@{HOST}/0", f"redis://***@{HOST}/0"),
        (f"redis://:pa?ss@{HOST}/0", "redis://***"),
        (f"redis://{HOST}/0?password=pa#ss", "redis://***"),
        (f"redis://{HOST}/0?PASSWORD=pass&prefix=x", f"redis://{HOST}/0?PASSWORD=***&***"),
        (f"redis://user:pa%23ss@{HOST}/0", f"redis://***@{HOST}/0"),
        ("file:///var/cache/kv?max_bytes=1GB", "file:///var/cache/kv?max_bytes=1GB"),
    ],
)
def test_urls_the_client_would_misread_are_shown_without_the_spilled_part(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("pw", ["pa#ss1234", "pa?ss1234", "pa/ss1234"])
def test_a_password_that_spills_past_the_host_is_a_one_line_error(pw: str) -> None:
    """redis-py would connect to another host with a cut password: refused, saying how to write it."""
    with pytest.raises(UserError, match="percent-encoded") as e:
        open_store(f"redis://:{pw}@{HOST}/0")
    assert "\n" not in str(e.value) and leaked(pw, "", str(e.value)) is None


def test_provenance_command_lines_are_redacted() -> None:
    argv = ["eval", "--store", f"redis://:hunter2#x@{HOST}/0", "--api-key=topsecret", "--api-key", "othersecret"]
    line = redact_argv(argv)
    assert "hunter2" not in line and "topsecret" not in line and "othersecret" not in line
    assert line.startswith("eval --store") and "***" in line
