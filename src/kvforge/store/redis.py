"""``redis://host:port/db``: entries in a Redis server, shared by every process and machine that can reach it.

Keys (``P`` = ``prefix``, default ``kvforge``)::

    P:seg:<key>:data:<nonce>:<i>   the encoded bytes, in chunks of at most ``chunk_bytes`` (Redis caps values)
    P:seg:<key>:meta               JSON {nonce, chunks, bytes, summary}: written AFTER the data, removed WITH it
    P:seg:sizes  P:seg:lru         hash key -> bytes, sorted set key -> last use (updated with the meta, atomically)
    (P:blob:... likewise for blobs, without LRU)

A write is two steps: 1) the data chunks, pipelined, each with a TTL; 2) ONE Lua script (atomic on the server) that
checks the chunks are all there, clears their TTL, swaps in the metadata, updates sizes and LRU and deletes the
previous version's chunks. A remove is one script too. So a writer killed at any point leaves either the old entry
or the new one, and at most chunks that expire on their own: never a visible partial entry, never keys without a TTL
that no metadata points to. A fresh nonce per write means a reader never mixes the chunks of two versions; chunks
Redis dropped on its own (``maxmemory``) make the entry a miss and it is removed. With ``max_bytes`` the least
recently used entries are evicted past that many bytes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvforge.errors import StoreUnavailableError, UserError, redis_unavailable
from kvforge.redact import redact_text, redact_url
from kvforge.store import codec
from kvforge.store.base import _KEY_RE, ByteStore, Kind, describe_error, usage_report

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 * 1024**2
ORPHAN_TTL_S = 3600  # data chunks expire unless the metadata write that commits them follows
READ_BATCH = 16  # chunks asked for per round trip: a read stops at the first missing one

# KEYS: meta, sizes, lru, the new data chunks. ARGV: meta JSON, entry key, bytes, time, data-key prefix, is_seg.
_COMMIT = """
for i = 4, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return 0 end
end
local old = redis.call('GET', KEYS[1])
for i = 4, #KEYS do redis.call('PERSIST', KEYS[i]) end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
if ARGV[6] == '1' then redis.call('ZADD', KEYS[3], ARGV[4], ARGV[2]) end
if old then
  local ok, m = pcall(cjson.decode, old)
  local new = cjson.decode(ARGV[1])
  if ok and type(m) == 'table' and type(m.chunks) == 'number' and m.nonce and m.nonce ~= new.nonce then
    for i = 0, m.chunks - 1 do redis.call('DEL', ARGV[5] .. m.nonce .. ':' .. i) end
  end
end
return 1
"""
# KEYS: meta, sizes, lru. ARGV: entry key, data-key prefix, is_seg.
_REMOVE = """
local old = redis.call('GET', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if ARGV[3] == '1' then redis.call('ZREM', KEYS[3], ARGV[1]) end
if old then
  local ok, m = pcall(cjson.decode, old)
  if ok and type(m) == 'table' and type(m.chunks) == 'number' and type(m.nonce) == 'string' then
    local missing = 0  -- a forged count stops at 16 missing chunks in a row
    for i = 0, m.chunks - 1 do
      if redis.call('DEL', ARGV[2] .. m.nonce .. ':' .. i) == 0 then missing = missing + 1 else missing = 0 end
      if missing >= 16 then break end
    end
  end
end
return 1
"""


# string-valued options of redis-py's connections that a URL may carry (those it parses itself are added at run time:
# redis.connection.URL_QUERY_ARGUMENT_PARSERS); each is passed through only if the installed client's connection class
# for the URL's scheme takes it (ssl_* need rediss://)
_STRING_OPTIONS = (
    "username", "password", "client_name", "lib_name", "lib_version", "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs",
    "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data", "ssl_password", "ssl_ciphers", "ssl_ocsp_expected_cert",
)  # fmt: skip
_OWN_OPTIONS = ("timeout", "retry_on_error")  # kvforge's `timeout` is the socket timeout; an error list is not text


def _keywords(cls: type) -> set[str]:
    """Keyword arguments accepted by ``cls`` and its bases (redis-py passes ``**kwargs`` up the chain)."""
    import inspect

    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names |= {n for n, p in inspect.signature(init).parameters.items() if p.kind is p.KEYWORD_ONLY
                      or p.kind is p.POSITIONAL_OR_KEYWORD} - {"self"}  # fmt: skip
    return names


def client_options(url: str) -> dict[str, Any]:
    """The options redis-py's ``from_url`` would read from ``url`` (its own parser), checked against what the
    installed client takes for the URL's scheme: an unknown option, an SSL option on a plain ``redis://`` URL or a
    value the client cannot parse is a one-line :class:`UserError` (never a TypeError at the first command)."""
    from redis import connection

    shown = redact_url(url)
    try:
        options = connection.parse_url(url)
    except ValueError as e:  # redis-py's messages name the option, not its value
        raise UserError(f"bad store URL {shown}: {redact_text(str(e))}") from None
    conn_class = options.pop("connection_class", connection.Connection)
    takes = _keywords(conn_class) | _keywords(connection.ConnectionPool)
    passable = (set(connection.URL_QUERY_ARGUMENT_PARSERS) | set(_STRING_OPTIONS)) - set(_OWN_OPTIONS)
    for name in sorted(options):
        if name in ("host", "port", "db", "username", "password"):
            continue
        if name not in passable:
            raise UserError(
                f"unknown option {name!r} in store URL {shown}; redis:// also takes the client's options "
                f"{', '.join(sorted(passable & takes))}"
            )
        if name not in takes:
            needs = "rediss:// (TLS)" if name.startswith("ssl") else "another redis client version"
            raise UserError(f"option {name!r} in store URL {shown} needs {needs}")
    _check_files(options, shown)
    return options


def _check_files(options: dict[str, Any], shown: str) -> None:
    """TLS files named in the URL exist (the client would raise a TypeError or OSError at its first command)."""
    from pathlib import Path

    for name, kind in (("ssl_keyfile", "file"), ("ssl_certfile", "file"), ("ssl_ca_certs", "file"),
                       ("ssl_ca_path", "folder")):  # fmt: skip
        value = options.get(name)
        if value is not None and not (Path(value).is_file() if kind == "file" else Path(value).is_dir()):
            raise UserError(f"{name} in store URL {shown}: no such {kind} {redact_text(str(value))!r}")
    if options.get("ssl_keyfile") and not options.get("ssl_certfile"):
        raise UserError(f"ssl_keyfile in store URL {shown} needs ssl_certfile (the certificate of that key)")


def client_from_url(url: str, connect_timeout_s: float, timeout_s: float) -> Any:
    """A redis-py client for ``url`` whose options were checked (:func:`client_options`) and whose connection was
    built once (not connected) so that a bad value fails now, in one line."""
    import redis

    client_options(url)
    client = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s)
    pool = client.connection_pool
    try:
        pool.connection_class(**pool.connection_kwargs).disconnect()
    except (TypeError, ValueError, redis.exceptions.RedisError) as e:
        raise UserError(f"bad store URL {redact_url(url)}: {redact_text(str(e))}") from None
    return client


class RedisStore(ByteStore):
    """A store in Redis through the ``redis`` client (``pip install 'kvforge[store]'``).

    Args:
        url: ``redis://[:password@]host:port/db`` (client options of redis-py's ``from_url`` allowed).
        max_bytes: evict least recently used entries past this many bytes; None = leave it to Redis' maxmemory.
        chunk_bytes: largest single Redis value; bigger entries are split.
        prefix: namespace of every Redis key, so several stores can share a database.
        connect_timeout_s: how long to wait for a connection before declaring Redis unavailable.
        timeout_s: how long one socket read or write may wait (a hung server is then unavailable, never a stall).

    Once opened, a Redis that stops answering is a miss for reads and a skipped write, with ONE warning per outage
    (and one when it answers again; the rule of :class:`~kvforge.store.base.ByteStore`): a request never fails because
    its cache tier went away. The URL appears in messages only redacted (``redis://***@host``).
    """

    scheme = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        max_bytes: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        prefix: str = "kvforge",
        quant: str | None = None,
        connect_timeout_s: float = 1.0,
        timeout_s: float = 2.0,
    ) -> None:
        super().__init__(quant)
        try:
            import redis
        except ImportError as e:
            raise StoreUnavailableError("the Redis store needs the redis client: pip install 'kvforge[store]'") from e
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.url, self.max_bytes, self.chunk_bytes, self.prefix = url, max_bytes, chunk_bytes, prefix
        self.display_url = redact_url(url)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._redis_error = redis.exceptions.RedisError
        self.io_errors = (*ByteStore.io_errors, redis.exceptions.RedisError)  # e.g. OOM under maxmemory, NOAUTH
        self._bad_names: set[str] = set()  # names in Redis that are not entry keys, warned about once
        self.retry_s = 5.0  # after an outage, answer misses at once for this long before asking Redis again
        self.client = client_from_url(url, connect_timeout_s, timeout_s)
        self._commit_script = self.client.register_script(_COMMIT)
        self._remove_script = self.client.register_script(_REMOVE)

    def __repr__(self) -> str:
        return f"RedisStore({self.display_url!r})"

    @property
    def display(self) -> str:
        return self.display_url

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except self._errors as e:
            raise redis_unavailable(self.display_url, redact_text(str(e))) from e

    def _call(self, fn: Callable[[], Any]) -> Any:
        with self._guard():
            return fn()

    def ping(self) -> None:
        try:
            self._call(self.client.ping)
        except self._redis_error as e:  # e.g. "DB index is out of range", a wrong password
            message = f"Redis store {self.display_url} refused the connection: {redact_text(str(e))}"
            raise StoreUnavailableError(message) from None
        except (TypeError, ValueError, OSError) as e:  # the client could not even connect (e.g. a TLS setting)
            message = f"Redis store {self.display_url} cannot connect: {type(e).__name__}: {redact_text(str(e))}"
            raise StoreUnavailableError(message) from None

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------------------------------ key names
    def _meta_key(self, key: str, kind: Kind) -> str:
        return f"{self.prefix}:{kind}:{key}:meta"

    def _data_prefix(self, key: str, kind: Kind) -> str:
        return f"{self.prefix}:{kind}:{key}:data:"

    def _chunk_keys(self, key: str, kind: Kind, meta: dict[str, Any]) -> list[str]:
        return [f"{self._data_prefix(key, kind)}{meta['nonce']}:{i}" for i in range(meta["chunks"])]

    def _sizes(self, kind: Kind) -> str:
        return f"{self.prefix}:{kind}:sizes"

    def _lru(self) -> str:
        return f"{self.prefix}:seg:lru"

    def _meta(self, key: str, kind: Kind) -> dict[str, Any] | None:
        """The entry's metadata, or None when absent or not what a writer makes (then reported once and removed)."""
        raw = self._call(lambda: self.client.get(self._meta_key(key, kind)))
        if raw is None:
            return None
        try:
            meta = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            meta = None
        problem = _meta_problem(meta, self.max_bytes if kind == "seg" else None)
        if problem is None:
            return meta  # type: ignore[no-any-return]
        self._bad(key, kind, f"metadata {problem}")
        return None

    def _bad(self, key: str, kind: Kind, why: str) -> None:
        """A malformed entry: a miss, reported once per entry, removed when Redis lets us."""
        with self.lock:
            self.num_corrupt += 1
        log.warning("redis store: entry %s is malformed (%s); treated as a miss and removed", key, why)
        with contextlib.suppress(self._redis_error, StoreUnavailableError):
            self.remove(key, kind)

    def _valid_sizes(self, kind: Kind) -> list[int]:
        """The sizes of the entries of the sizes hash that are entry keys."""
        found = self._call(lambda: self.client.hgetall(self._sizes(kind)))
        keep = set(self._names(list(found), "the sizes hash"))
        return _sizes([v for k, v in found.items() if k.decode("utf-8", "replace") in keep])

    def _names(self, raw: list[bytes], what: str) -> list[str]:
        """Entry names read from Redis that are valid keys (others, written by something else, are skipped, with
        one warning the first time each is met)."""
        names = [r.decode("utf-8", "replace") if isinstance(r, bytes) else str(r) for r in raw]
        good = [n for n in names if _KEY_RE.match(n)]
        if len(good) != len(names):
            bad = set(names) - set(good)
            with self.lock:
                new, self._bad_names = bad - self._bad_names, self._bad_names | bad
            if new:
                log.warning("redis store: %d name(s) in %s are not entry keys; ignored", len(new), what)
        return good

    # ------------------------------------------------------------------------------------------ raw bytes
    def read(self, key: str, kind: Kind = "seg") -> bytearray | None:
        meta = self._meta(key, kind)
        if meta is None:
            return None
        out, prefix = bytearray(), f"{self._data_prefix(key, kind)}{meta['nonce']}:"
        with self._guard():
            for at in range(0, max(meta["chunks"], 1), READ_BATCH):  # a few per round trip, up to a missing one
                pipe = self.client.pipeline(transaction=False)
                batch = range(at, min(at + READ_BATCH, meta["chunks"]))
                for i in batch:
                    pipe.get(f"{prefix}{i}")
                if kind == "seg" and at == 0:
                    pipe.zadd(self._lru(), {key: time.time()}, xx=True)
                replies = pipe.execute()[: len(batch)]
                if any(c is None for c in replies):  # Redis dropped data, or a rewrite replaced this version
                    if self._meta(key, kind) == meta:
                        log.warning("redis store: entry %s lost part of its data; treated as a miss and removed", key)
                        self.remove(key, kind)
                    return None
                for c in replies:
                    out += c
                if len(out) > meta["bytes"]:  # more than declared: not read further
                    break
        if len(out) != meta["bytes"]:
            self._bad(key, kind, f"its chunks hold {len(out)}+ bytes, its metadata says {meta['bytes']}")
            return None
        return out

    def write(self, key: str, data: bytes, kind: Kind = "seg") -> bool:
        view = memoryview(data).cast("B")
        size = view.nbytes
        if kind == "seg" and self.max_bytes is not None and size > self.max_bytes:
            log.warning("redis store: entry %s (%d bytes) exceeds max_bytes=%d; not stored", key, size, self.max_bytes)
            return False
        meta: dict[str, Any] = {
            "nonce": secrets.token_hex(6),
            "chunks": -(-size // self.chunk_bytes),
            "bytes": size,
            "time": time.time(),
        }
        if kind == "seg":
            meta["summary"] = codec.summarize(codec.read_header(view), size)
        chunk_keys = self._chunk_keys(key, kind, meta)
        try:
            with self._guard():
                pipe = self.client.pipeline(transaction=False)  # 1) data, with a TTL: a writer killed before
                for i, name in enumerate(chunk_keys):  # its commit leaves chunks that expire on their own
                    pipe.set(name, view[i * self.chunk_bytes : (i + 1) * self.chunk_bytes], ex=ORPHAN_TTL_S)
                pipe.execute()
                committed = self._commit_script(  # 2) one atomic script: metadata, sizes, LRU, old chunks gone
                    keys=[self._meta_key(key, kind), self._sizes(kind), self._lru(), *chunk_keys],
                    args=[json.dumps(meta), key, size, repr(meta["time"]), self._data_prefix(key, kind),
                          int(kind == "seg")],
                )  # fmt: skip
        except self._redis_error:  # e.g. OOM under maxmemory: the rule skips the write; its chunks go now
            with contextlib.suppress(self._redis_error, StoreUnavailableError):
                self._call(lambda: self.client.delete(*chunk_keys) if chunk_keys else 0)
            raise
        if not committed:  # a chunk was dropped (maxmemory) between the two steps: nothing was committed
            log.warning("redis store: %s lost data before its commit (Redis maxmemory?); not stored", key)
            self._call(lambda: self.client.delete(*chunk_keys) if chunk_keys else 0)
            return False
        if kind == "seg":
            try:
                self._evict(keep=key)
            except self.io_errors as e:  # the entry is stored; the eviction is tried again by the next write
                log.debug("redis store: eviction after %s failed: %s", key, describe_error(e))
        return True

    def _evict(self, keep: str) -> None:
        if self.max_bytes is None:
            return
        total = sum(_sizes(self._call(lambda: self.client.hvals(self._sizes("seg")))))
        if total <= self.max_bytes:
            return
        raw_sizes = self._call(lambda: self.client.hgetall(self._sizes("seg")))
        sizes = {
            k.decode("utf-8", "replace"): n for k, n in zip(raw_sizes, _sizes(list(raw_sizes.values())), strict=True)
        }
        for old in self._names(self._call(lambda: self.client.zrange(self._lru(), 0, -1)), "the LRU set"):
            if total <= self.max_bytes:
                break
            if old == keep:
                continue
            self.discard(old)
            total -= sizes.get(old, 0)
            self.num_evicted += 1
            log.debug("redis store: evicted %s", old)

    def remove(self, key: str, kind: Kind = "seg") -> None:
        self._call(  # one atomic script: metadata, sizes, LRU and the chunks it points to
            lambda: self._remove_script(
                keys=[self._meta_key(key, kind), self._sizes(kind), self._lru()],
                args=[key, self._data_prefix(key, kind), int(kind == "seg")],
            )
        )

    def has(self, key: str, kind: Kind = "seg") -> bool:
        return bool(self._call(lambda: self.client.exists(self._meta_key(key, kind))))

    def list_keys(self, kind: Kind = "seg") -> list[str]:
        if kind == "seg":
            return self._names(self._call(lambda: self.client.zrange(self._lru(), 0, -1)), "the LRU set")
        return sorted(self._names(self._call(lambda: self.client.hkeys(self._sizes(kind))), "the sizes hash"))

    def touch(self, key: str) -> None:
        self._call(lambda: self.client.zadd(self._lru(), {key: time.time()}, xx=True))

    def describe(self, key: str) -> dict[str, Any] | None:
        meta = self._io("read", key, lambda: self._meta(key, "seg"), None)  # the summary is in the metadata: no data
        summary = None if meta is None else meta.get("summary")
        return summary if isinstance(summary, dict) else None

    def stored_size_raw(self, key: str) -> int | None:
        meta = self._meta(key, "seg")
        return None if meta is None else int(meta["bytes"])

    def usage(self) -> dict[str, Any]:
        sizes, blob_sizes = (self._valid_sizes(kind) for kind in ("seg", "blob"))
        info = self._call(lambda: self.client.info("memory"))
        memory = {f"redis_{k}": info.get(k) for k in ("used_memory", "maxmemory", "maxmemory_policy")}
        return usage_report(self.display_url, len(sizes), sum(sizes), self.max_bytes, blob_sizes,
                            chunk_bytes=self.chunk_bytes, **memory)  # fmt: skip


def _sizes(values: list[Any]) -> list[int]:
    """Sizes read from a sizes hash, a value that is not a byte count (written by something else) counted as 0."""
    out = []
    for v in values:
        try:
            out.append(max(int(v), 0))
        except (TypeError, ValueError):
            out.append(0)
    return out


def _meta_problem(meta: Any, max_bytes: int | None) -> str | None:
    """What is wrong with an entry's metadata (None: what a writer makes): a hex nonce, whole numbers of bytes and of
    non-empty chunks (``chunks`` <= ``bytes``), within ``max_bytes`` when the store has one."""
    if not isinstance(meta, dict):
        return "is not a JSON object"
    nonce, chunks, size = meta.get("nonce"), meta.get("chunks"), meta.get("bytes")
    if not isinstance(nonce, str) or not nonce or not all(c in "0123456789abcdef" for c in nonce) or len(nonce) > 64:
        return "has no valid nonce"
    if type(chunks) is not int or type(size) is not int or chunks < 0 or size < 0:
        return f"declares chunks={str(chunks)[:20]!r}, bytes={str(size)[:20]!r} (not whole numbers)"
    if chunks > size or (size > 0 and chunks == 0):
        return f"declares {chunks} chunks for {size} bytes"
    if max_bytes is not None and size > max_bytes:
        return f"declares {size} bytes, over max_bytes={max_bytes}"
    return None
