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
from kvforge.store.base import ByteStore, KVStore, check_key, parse_size
from kvforge.store.codec import check_segment, decode, encode
from kvforge.store.disk import DiskStore
from kvforge.store.memory import MemoryStore
from kvforge.store.tiered import TieredStore

SCHEMES = ("memory://", "file://", "redis://", "rediss://")
_PARAMS = {
    "memory": {"max_bytes", "quant"},
    "file": {"max_bytes", "fsync", "quant"},
    "redis": {"max_bytes", "chunk_bytes", "prefix", "quant"},  # other parameters go to the redis client
}


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {value!r}")


def _open_one(url: str) -> ByteStore:
    parts = urlsplit(url)
    scheme = "redis" if parts.scheme == "rediss" else parts.scheme
    if scheme not in _PARAMS or "://" not in url:
        raise UserError(
            f"unknown store URL {url!r}: supported are {', '.join(SCHEMES)} (e.g. file:///abs/path, "
            "redis://127.0.0.1:6379/0), or a comma-separated list of them for a tiered store"
        )
    params = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = set(params) - _PARAMS[scheme]
    if unknown and scheme != "redis":
        raise UserError(
            f"unknown option(s) {sorted(unknown)} in store URL {url!r}; {scheme} takes {sorted(_PARAMS[scheme])}"
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
            path = parts.netloc + parts.path  # file:///abs -> /abs; file://rel/dir -> rel/dir
            if "fsync" in params:
                kwargs["fsync"] = _bool(params["fsync"])
            return DiskStore(path or str(cache_dir() / "kv"), **kwargs)
        from kvforge.store.redis import RedisStore

        if "chunk_bytes" in params:
            kwargs["chunk_bytes"] = parse_size(params["chunk_bytes"])
        if "prefix" in params:
            kwargs["prefix"] = params["prefix"]
        client_query = urlencode({k: v for k, v in params.items() if k in unknown})
        client_url = urlunsplit((parts.scheme, parts.netloc, parts.path or "/0", client_query, ""))
        return RedisStore(client_url, **kwargs)
    except ValueError as e:
        raise UserError(f"bad store URL {url!r}: {e}") from e


def open_store(url: str) -> KVStore:
    """Open a store from its URL; a comma-separated list gives a :class:`TieredStore` (fastest tier first).

    Raises:
        UserError: unknown scheme or option.
        StoreUnavailableError: a single Redis store that cannot be reached (in a tiered store it is skipped instead).
    """
    urls = [u.strip() for u in url.split(",") if u.strip()]
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
    "DiskStore",
    "KVStore",
    "MemoryStore",
    "TieredStore",
    "check_key",
    "check_segment",
    "decode",
    "default_store_url",
    "encode",
    "open_store",
]
