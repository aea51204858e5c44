"""Secrets never leave kvforge: store URLs appear in messages, logs, HTTP bodies, metric labels, ``--help`` and result
provenance only through :func:`redact_url` (one URL) or :func:`redact_text` (any text, e.g. a client library's error).

A URL is read the way its client reads it (``urllib.parse.urlsplit``, as redis-py's ``from_url`` does), and what is
shown is rebuilt from the parts known not to be secret: the user info (user name and password: a password may hold a
``:``), every secret-named query value (``password``, ``PASSWORD``, ``token``...) and what follows it (a password may
hold an ``&``) become ``***``. A password holding a character the URL syntax cuts at (an unencoded ``#``, ``?`` or
``/``) spills part of itself past the host; such a URL is shown as ``redis://***`` (or ``redis://***@host/0`` when the
host is unambiguous), never with the spilled part. Every secret met is remembered, so :func:`redact_text` also hides
it where it appears without its URL (at least 3 characters long).

Imports nothing heavy (the CLI uses it while building ``--help``).
"""

from __future__ import annotations

import logging
import re
import shlex
from urllib.parse import parse_qsl, unquote, urlsplit

STARS = "***"
_SECRET_WORDS = ("password", "passwd", "pwd", "secret", "token", "apikey", "api_key", "auth", "credential")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HOST_RE = re.compile(r"^[A-Za-z0-9.\-\[\]:]*(/[0-9]*)?$")  # host[:port][/db]: nothing a password could hide in
_URL_IN_TEXT_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*")  # to the next space: a URL's end is unknowable
_SECRET_FLAGS = ("--api-key", "--store", "--password")  # command-line options whose value is secret or holds one
_seen: set[str] = set()  # secrets met so far: hidden by redact_text wherever they appear


def is_secret_key(name: str) -> bool:
    """Whether a query parameter carries a secret (``password``, ``PASSWORD``, ``ssl_password``, ``token``...)."""
    low = name.lower()
    return low == "pass" or any(word in low for word in _SECRET_WORDS)


def split_urls(text: str) -> list[str]:
    """A store URL list split into its URLs: at a comma followed by a URL scheme only, so a password holding a comma
    stays in its URL."""
    return [u.strip() for u in re.split(r",(?=\s*[A-Za-z][A-Za-z0-9+.-]*://)", str(text)) if u.strip()]


def spilled_userinfo(url: str) -> bool:
    """Whether a user name or password holds a character the URL syntax cuts at (unencoded ``/``, ``?``, ``#``),
    so part of it lies past the host: an ``@`` after the host that is not inside a secret query value, or a
    fragment (store URLs have none: a ``#`` was meant as part of a secret)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "@" in url
    if parts.fragment or "#" in url:
        return True
    if "@" in parts.path:
        return True
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if "@" in key or ("@" in value and not is_secret_key(key)):
            return True
    return False


def _remember(secret: str | None) -> None:
    if secret and len(secret) >= 3:
        _seen.update({secret, unquote(secret)})


def _redact_one(url: str) -> str:
    match = _SCHEME_RE.match(url)
    if match is None:  # not a URL: hide it whole if it could hold a secret
        if "@" in url or "=" in url:
            _remember(url)
            return STARS
        return url
    scheme = match.group(1)
    if spilled_userinfo(url):
        head, _, host = url.rpartition("@")
        _remember(head[len(scheme) + 3 :])
        if "@" in url and "?" not in head and _HOST_RE.match(host):
            return f"{scheme}://{STARS}@{host}"
        return f"{scheme}://{STARS}"
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an odd IPv6 host: nothing of it is shown
        return f"{scheme}://{STARS}"
    netloc = parts.netloc
    if "@" in netloc:  # the whole userinfo goes: a user name may be a password cut at a ':' it holds
        userinfo, _, host = netloc.rpartition("@")
        _remember(userinfo)
        _remember(userinfo.partition(":")[2])
        netloc = f"{STARS}@{host}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if not any(is_secret_key(k) for k, _ in pairs) and netloc == parts.netloc:
        return url  # nothing to hide: unchanged (rebuilding would drop the "//" of "memory://")
    shown, after_secret = [], False
    for key, value in pairs:
        if after_secret and not is_secret_key(key):  # may be the rest of a password holding an unencoded '&'
            _remember(key)
            shown.append(STARS)
            continue
        if is_secret_key(key):
            _remember(value)
            after_secret = True
        shown.append(f"{key}={STARS if is_secret_key(key) else value}")
    return f"{scheme}://{netloc}{parts.path}" + (f"?{'&'.join(shown)}" if shown else "")


def names_after_secret(url: str) -> set[str]:
    """Query names that follow a secret one: they may be the rest of a password holding an unencoded ``&``, so a
    message never names them."""
    try:
        pairs = parse_qsl(urlsplit(url).query, keep_blank_values=True)
    except ValueError:
        return set()
    first = next((i for i, (k, _) in enumerate(pairs) if is_secret_key(k)), len(pairs))
    return {k for k, _ in pairs[first + 1 :] if not is_secret_key(k)}


def redact_url(url: str) -> str:
    """``url`` (one store URL or a comma-separated list) without its secrets: the only form in which a store URL may
    appear in a message, a log line, an HTTP body, a metric label or a saved result."""
    return ",".join(_redact_one(u) for u in split_urls(url)) if str(url).strip() else str(url)


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted and every secret met so far replaced by ``***``."""
    out = _URL_IN_TEXT_RE.sub(lambda m: redact_url(m.group(0)), str(text))
    for secret in sorted(_seen, key=len, reverse=True):
        if secret in out:
            out = out.replace(secret, STARS)
    return out


def redact_argv(argv: list[str]) -> str:
    """A command line as one shell-quoted string, without secrets: the value of ``--api-key`` hidden, store URLs
    (``--store``, or any argument holding ``://``) redacted. What provenance records."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if (i and argv[i - 1] == "--api-key") or (eq and flag == "--api-key"):
            out.append(f"{flag}={STARS}" if eq else STARS)
        elif eq and flag in _SECRET_FLAGS:
            out.append(f"{flag}={redact_url(value)}")
        elif i and argv[i - 1] in _SECRET_FLAGS:
            out.append(redact_url(arg))
        else:
            out.append(redact_text(arg))
    return " ".join(shlex.quote(a) for a in out)


class RedactFilter(logging.Filter):
    """A logging filter that passes every record through :func:`redact_text` (installed on the CLI's handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True
