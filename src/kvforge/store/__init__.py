"""KV stores opened by URL: ``memory://``, ``file:///path`` (the embedded default), ``redis://host:port/db``, or a
comma-separated list of them for a tiered store (fastest first)::

    store = open_store("memory://?max_bytes=2GB,file:///var/cache/kv?max_bytes=50GB,redis://10.0.0.5:6379/0")
    store.put(key, segment)
    segment = store.get(key)  # None on a miss
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvforge.errors import UserError
from kvforge.paths import cache_dir, default_store_url
from kvforge.redact import names_after_secret, redact_url, spilled_userinfo, split_urls
from kvforge.store.base import ByteStore, ClearResult, KVStore, WriteLog, check_key, parse_size, track_writes
from kvforge.store.codec import check_segment, decode, encode, quant_roundtrip
from kvforge.store.disk import DiskStore
from kvforge.store.memory import MemoryStore
from kvforge.store.tiered import TieredStore

SCHEMES = ("memory://", "file://", "redis://", "rediss://")
_PARAMS = {
    "memory": {"max_bytes", "quant"},
    "file": {"max_bytes", "fsync", "quant", "read_only"},
    "redis": {"max_bytes", "chunk_bytes", "prefix", "quant", "timeout", "connect_timeout"},
}  # a redis URL's other options go to the client (kvforge.store.redis.client_options checks them)


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {value!r}")


def _number(name: str, text: str, low: float, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None
    if not low <= value <= high:  # also refuses nan and inf
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {text!r}")
    return value


def _open_one(url: str) -> ByteStore:
    shown = redact_url(url)
    if spilled_userinfo(url) and ("@" in url or url.startswith("redis")):
        raise UserError(
            f"bad store URL {shown!r}: its user name or password holds a character that must be percent-encoded "
            "('#' as %23, '?' as %3F, '/' as %2F, '@' as %40), or give the password as ?password=..."
        )
    try:
        parts = urlsplit(url)
    except ValueError:
        raise UserError(f"bad store URL {shown!r}: cannot parse it (e.g. an unclosed '[' of an IPv6 host)") from None
    try:
        parts.port  # noqa: B018 (validates the port)
    except ValueError:  # its message would echo the text after ':', which may be a password
        raise UserError(f"bad store URL {shown!r}: the port must be a number in 0..65535") from None
    scheme = "redis" if parts.scheme == "rediss" else parts.scheme
    if scheme not in _PARAMS or "://" not in url:
        raise UserError(
            f"unknown store URL {shown!r}: supported are {', '.join(SCHEMES)} (e.g. file:///abs/path, "
            "redis://127.0.0.1:6379/0), or a comma-separated list of them for a tiered store"
        )
    params = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = set(params) - _PARAMS[scheme]
    if unknown & names_after_secret(url):  # never name them: they may be part of the password
        raise UserError(
            f"bad store URL {shown!r}: an unknown option follows the password; if the password holds '&', write it "
            "as %26"
        )
    if unknown and scheme != "redis":
        raise UserError(
            f"unknown option(s) {sorted(unknown)} in store URL {shown!r}; {scheme} takes {sorted(_PARAMS[scheme])}"
        )
    kwargs: dict[str, Any] = {}
    try:
        if "max_bytes" in params:
            kwargs["max_bytes"] = parse_size(params["max_bytes"])
        if "quant" in params:
            kwargs["quant"] = params["quant"]
        if scheme == "memory":
            return MemoryStore(**kwargs)
        if scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise ValueError(
                    f"a file store needs an absolute path: file:///abs/path (three slashes); {parts.netloc!r} would "
                    "be read as a relative folder"
                )
            if "fsync" in params:
                kwargs["fsync"] = _bool(params["fsync"])
            if "read_only" in params:
                kwargs["read_only"] = _bool(params["read_only"])
            return DiskStore(parts.path or str(cache_dir() / "kv"), **kwargs)
        from kvforge.store.redis import RedisStore

        db = parts.path.strip("/") or "0"
        if not db.isdigit() or int(db) > 65535:
            raise ValueError("the database must be a number (redis://host:port/0)")
        if "chunk_bytes" in params:
            kwargs["chunk_bytes"] = parse_size(params["chunk_bytes"])
        if "prefix" in params:
            kwargs["prefix"] = params["prefix"]
        if "timeout" in params:
            kwargs["timeout_s"] = _number("timeout", params["timeout"], 0.01, 3600)
        if "connect_timeout" in params:
            kwargs["connect_timeout_s"] = _number("connect_timeout", params["connect_timeout"], 0.01, 3600)
        client_query = urlencode({k: v for k, v in params.items() if k in unknown})  # the client's own options
        client_url = urlunsplit((parts.scheme, parts.netloc, f"/{int(db)}", client_query, ""))
        return RedisStore(client_url, **kwargs)
    except (ValueError, OverflowError) as e:
        raise UserError(f"bad store URL {shown!r}: {e}") from None


def open_store(url: str) -> KVStore:
    """Open a store from its URL; a comma-separated list gives a :class:`TieredStore` (fastest tier first).

    Raises:
        UserError: unknown scheme or option.
        StoreUnavailableError: a single Redis store that cannot be reached (in a tiered store it is skipped instead).
    """
    if not isinstance(url, str):
        raise UserError(f"a store URL must be text, got {type(url).__name__}")
    urls = split_urls(url)
    if not urls:
        raise UserError("empty store URL")
    stores = [_open_one(u) for u in urls]
    if len(stores) == 1:
        stores[0].ping()
        return stores[0]
    return TieredStore(stores)


__all__ = [
    "SCHEMES",
    "ByteStore",
    "ClearResult",
    "DiskStore",
    "KVStore",
    "MemoryStore",
    "TieredStore",
    "WriteLog",
    "check_key",
    "check_segment",
    "decode",
    "default_store_url",
    "encode",
    "open_store",
    "quant_roundtrip",
    "track_writes",
]
