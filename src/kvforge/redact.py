"""Secrets never leave kvforge: store URLs appear in messages, logs, HTTP bodies and metric labels only redacted.

Imports nothing heavy (the CLI uses it while building ``--help``).
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit, urlunsplit

_SECRET_PARAMS = ("password",)


def redact_url(url: str) -> str:
    """``url`` (one store URL or a comma-separated list) with any password replaced by ``***``: the only form in
    which a store URL may appear in a message, a log line, an HTTP body or a metric label."""
    out = []
    for one in str(url).split(","):
        try:
            parts = urlsplit(one)
            netloc = parts.netloc
        except ValueError:
            out.append("<unparsable URL>")
            continue
        secret_query = any(k in _SECRET_PARAMS for k, _ in parse_qsl(parts.query, keep_blank_values=True))
        if "@" not in netloc and not secret_query:
            out.append(one)  # nothing to hide: unchanged (urlunsplit would drop the "//" of "memory://")
            continue
        if "@" in netloc:
            userinfo, _, host = netloc.rpartition("@")
            user, sep, _password = userinfo.partition(":")
            netloc = f"{user}:***@{host}" if sep else f"***@{host}"  # a lone userinfo may be a password too
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = "&".join(f"{k}={'***' if k in _SECRET_PARAMS else v}" for k, v in pairs)
        out.append(urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment)))
    return ",".join(out)

