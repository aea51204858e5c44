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

import json
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from kvforge.errors import StoreUnavailableError, redis_unavailable
from kvforge.redact import redact_url
from kvforge.store import codec
from kvforge.store.base import ByteStore, Kind

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 * 1024**2
ORPHAN_TTL_S = 3600  # data chunks expire unless the metadata write that commits them follows

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
  if ok and type(m) == 'table' and type(m.chunks) == 'number' and m.nonce then
    for i = 0, m.chunks - 1 do redis.call('DEL', ARGV[2] .. m.nonce .. ':' .. i) end
  end
end
return 1
"""


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
    (and one when it answers again): a request never fails because its cache tier went away. The URL appears in
    messages only redacted (``redis://:***@host``).
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
        self._response_error = redis.exceptions.ResponseError
        self._down = False
        self._failed_at = 0.0
        self.retry_s = 5.0  # after a failed call, answer misses at once for this long before asking Redis again
        self.client = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s)
        self._commit_script = self.client.register_script(_COMMIT)
        self._remove_script = self.client.register_script(_REMOVE)

    def __repr__(self) -> str:
        return f"RedisStore({self.display_url!r})"

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except self._errors as e:
            raise redis_unavailable(self.display_url, self._scrub(str(e))) from e

    def _call(self, fn: Callable[[], Any]) -> Any:
        with self._guard():
            return fn()

    def _scrub(self, text: str) -> str:
        """``text`` without the URL's password (client errors name the host only, but never trust that)."""
        password = urlsplit(self.url).password
        return text.replace(password, "***") if password else text

    def ping(self) -> None:
        try:
            self._call(self.client.ping)
        except self._response_error as e:  # e.g. "DB index is out of range"
            message = f"Redis store {self.display_url} refused the connection: {self._scrub(str(e))}"
            raise StoreUnavailableError(message) from None

    def _soft(self, fn: Callable[[], Any], default: Any) -> Any:
        """``fn()``, or ``default`` with one warning per outage when Redis does not answer (dead or hung).

        After a failure Redis is not asked again for ``retry_s`` seconds, so an outage costs one timeout, not one
        per call."""
        if self._down and time.monotonic() < self._failed_at + self.retry_s:
            return default
        try:
            out = fn()
        except StoreUnavailableError as e:
            self._failed_at = time.monotonic()
            if not self._down:
                self._down = True
                log.warning("%s: reads are misses and writes are skipped until it answers again", e)
            return default
        if self._down:
            self._down = False
            log.warning("Redis store %s is available again", self.display_url)
        return out

    def get(self, key: str) -> Any:
        return self._soft(lambda: super(RedisStore, self).get(key), None)

    def put(self, key: str, segment: Any, quant: str | None = None) -> None:
        self._soft(lambda: super(RedisStore, self).put(key, segment, quant), None)

    def contains(self, key: str) -> bool:
        return bool(self._soft(lambda: super(RedisStore, self).contains(key), False))

    def keys(self) -> list[str]:
        return list(self._soft(lambda: super(RedisStore, self).keys(), []))

    def get_blob(self, key: str) -> bytes | None:
        return self._soft(lambda: super(RedisStore, self).get_blob(key), None)

    def put_blob(self, key: str, data: bytes) -> None:
        self._soft(lambda: super(RedisStore, self).put_blob(key, data), None)

    def delete_blob(self, key: str) -> None:
        self._soft(lambda: super(RedisStore, self).delete_blob(key), None)

    def blob_keys(self) -> list[str]:
        return list(self._soft(lambda: super(RedisStore, self).blob_keys(), []))

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
        raw = self._call(lambda: self.client.get(self._meta_key(key, kind)))
        if raw is None:
            return None
        try:
            meta = json.loads(raw)
            return meta if isinstance(meta, dict) and {"nonce", "chunks", "bytes"} <= meta.keys() else None
        except json.JSONDecodeError:
            return None

    # ------------------------------------------------------------------------------------------ raw bytes
    def read(self, key: str, kind: Kind = "seg") -> bytearray | None:
        meta = self._meta(key, kind)
        if meta is None:
            return None
        with self._guard():
            pipe = self.client.pipeline(transaction=False)  # one round trip: the chunks and the LRU stamp
            for name in self._chunk_keys(key, kind, meta):
                pipe.get(name)
            if kind == "seg":
                pipe.zadd(self._lru(), {key: time.time()}, xx=True)
            replies = pipe.execute()
        chunks = replies[: meta["chunks"]]
        if any(c is None for c in chunks):  # Redis dropped data, or a concurrent rewrite replaced this version
            if self._meta(key, kind) == meta:
                log.warning("redis store: entry %s lost part of its data; treated as a miss and removed", key)
                self.remove(key, kind)
            return None
        return bytearray().join(chunks)

    def write(self, key: str, data: bytes, kind: Kind = "seg") -> None:
        view = memoryview(data).cast("B")
        size = view.nbytes
        if kind == "seg" and self.max_bytes is not None and size > self.max_bytes:
            log.warning("redis store: entry %s (%d bytes) exceeds max_bytes=%d; not stored", key, size, self.max_bytes)
            return
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
        except self._response_error as e:  # e.g. OOM under maxmemory: a failed write is not fatal
            log.warning("redis store: could not write %s (%s)", key, e)
            self._call(lambda: self.client.delete(*chunk_keys) if chunk_keys else 0)
            return
        if not committed:  # a chunk was dropped (maxmemory) between the two steps: nothing was committed
            log.warning("redis store: %s lost data before its commit (Redis maxmemory?); not stored", key)
            self._call(lambda: self.client.delete(*chunk_keys) if chunk_keys else 0)
            return
        if kind == "seg":
            self._evict(keep=key)

    def _evict(self, keep: str) -> None:
        if self.max_bytes is None:
            return
        total = sum(int(v) for v in self._call(lambda: self.client.hvals(self._sizes("seg"))))
        if total <= self.max_bytes:
            return
        sizes = {k.decode(): int(v) for k, v in self._call(lambda: self.client.hgetall(self._sizes("seg"))).items()}
        for raw in self._call(lambda: self.client.zrange(self._lru(), 0, -1)):
            old = raw.decode()
            if total <= self.max_bytes:
                break
            if old == keep:
                continue
            self.remove(old)
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
            return [k.decode() for k in self._call(lambda: self.client.zrange(self._lru(), 0, -1))]
        return sorted(k.decode() for k in self._call(lambda: self.client.hkeys(self._sizes(kind))))

    def touch(self, key: str) -> None:
        self._call(lambda: self.client.zadd(self._lru(), {key: time.time()}, xx=True))

    def describe(self, key: str) -> dict[str, Any] | None:
        meta = self._soft(lambda: self._meta(key, "seg"), None)  # the summary travels in the metadata: no data
        return None if meta is None else meta.get("summary")

    def stored_size(self, key: str) -> int | None:
        meta = self._meta(key, "seg")
        return None if meta is None else int(meta["bytes"])

    def usage(self) -> dict[str, Any]:
        sizes = [int(v) for v in self._call(lambda: self.client.hvals(self._sizes("seg")))]
        blob_sizes = [int(v) for v in self._call(lambda: self.client.hvals(self._sizes("blob")))]
        info = self._call(lambda: self.client.info("memory"))
        return {
            "url": self.display_url,
            "entries": len(sizes),
            "bytes": sum(sizes),
            "capacity": self.max_bytes,
            "blobs": len(blob_sizes),
            "blob_bytes": sum(blob_sizes),
            "chunk_bytes": self.chunk_bytes,
            "redis_used_memory": info.get("used_memory"),
            "redis_maxmemory": info.get("maxmemory"),
            "redis_maxmemory_policy": info.get("maxmemory_policy"),
        }
