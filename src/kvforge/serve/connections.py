"""Connections of ``kvforge serve`` and ``kvforge route`` under abuse: read timeouts, a cap on open connections below
the process's file limit, and one warning per cause instead of a traceback per connection.

uvicorn closes a connection idle between requests (``timeout_keep_alive``) but waits forever for the rest of a
request once one byte of it has come, and accepts connections until the process runs out of file descriptors (then
asyncio logs a traceback per refused accept). :class:`GuardedH11Protocol` adds what is missing:

- a request's headers must arrive within ``read_timeout_s`` of its first byte (of the connection for the first
  request), else ``408`` and the connection is closed; a body may pause at most ``read_timeout_s`` between chunks;
- beyond ``max_connections`` open connections a new one is answered ``503`` at once and closed, so the file limit
  (raised to its hard limit at start) is never reached.

:func:`quiet_connection_logs` makes each per-connection message (an invalid request, a refused accept, a timeout) one
warning per cause and minute, with how many were not logged, never a traceback.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from typing import Any

from kvforge.serve.errors import error_body

logger = logging.getLogger("kvforge.serve.connections")

DEFAULT_READ_TIMEOUT_S = 10.0
FD_RESERVE = 128  # file descriptors kept for everything else (model files, store entries, logs, upstream clients)
LOG_EVERY_S = 60.0
LINGER_S = 0.5  # a refused connection reads and drops what the client still sends this long before it is closed


def raise_file_limit() -> int:
    """Raise the soft limit on open files to the hard limit (best effort); the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return int(soft)


def default_max_connections() -> int:
    """Open connections allowed: the file limit (raised) less :data:`FD_RESERVE`, at least 16."""
    return max(16, raise_file_limit() - FD_RESERVE)


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(error_body(message, "server_error" if status >= 500 else "invalid_request_error", None, code))
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n\r\n"
    )
    return (head + body).encode()


def protocol_class(max_connections: int, read_timeout_s: float) -> type:
    """uvicorn's h11 protocol with the read timeouts and the connection cap (pass as ``uvicorn.Config(http=...)``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if max_connections < 1 or not read_timeout_s > 0:
        raise ValueError("max_connections must be >= 1 and read_timeout_s > 0")

    class GuardedH11Protocol(H11Protocol):  # type: ignore[misc]
        _timer: Any = None
        _refused = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                note("connections", f"over {max_connections} open connections: new ones are answered 503")
                self._refuse(503, "Service Unavailable", "too many open connections; retry later", "server_busy")
                return
            self._arm()

        def _data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.IDLE and not self.transport.is_closing():
                if self._timer is None:  # the first bytes of a next request on a kept-alive connection
                    self._arm()
            elif state is h11.SEND_BODY:
                self._arm()  # a body may pause read_timeout_s between chunks
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(read_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _timed_out(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            state = self.conn.their_state
            if state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
                note("read-timeout", f"a request's headers did not arrive within {read_timeout_s:g} s: answered 408")
                self._refuse(408, "Request Timeout", f"request not received within {read_timeout_s:g} s", "timeout")
            elif state is h11.SEND_BODY:
                note("body-timeout", f"a request body paused over {read_timeout_s:g} s: connection closed")
                self.transport.close()

        def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
            """Answer and close, lingering a moment: what the client still sends is read and dropped, so the kernel
            does not reset the connection before the client has read the answer."""
            self._disarm()
            self._refused = True
            self.transport.write(_raw_response(status, reason, message, code))
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            self._data_received(data)

    return GuardedH11Protocol


# ---------------------------------------------------------------------------------------------- logs
_seen: dict[str, list[float]] = {}  # cause -> [last logged at, not logged since]


def note(cause: str, message: str) -> None:
    """Log ``message`` as a warning once per ``cause`` and minute (with how many were not logged meanwhile)."""
    if _once(cause):
        logger.warning("%s%s", message, _since(cause))


def _once(cause: str) -> bool:
    now = time.monotonic()
    seen = _seen.setdefault(cause, [float("-inf"), 0])
    if now - seen[0] < LOG_EVERY_S:
        seen[1] += 1
        return False
    seen[0] = now
    return True


def _since(cause: str) -> str:
    count = int(_seen[cause][1])
    _seen[cause][1] = 0
    return f" ({count} more since the last such message)" if count else ""


class OncePerCause(logging.Filter):
    """Per-connection messages of asyncio and uvicorn (a refused accept, an invalid request, a connection reset, the
    concurrency limit) logged as one warning per cause and minute, without their traceback."""

    NOISY = ("Invalid HTTP request received.", "Exceeded concurrency limit.")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error" and record.msg not in self.NOISY:
            return True  # the server's own messages, and an application error's traceback, stay as they are
        exc = record.exc_info[1] if record.exc_info else None
        cause = f"{record.name}:{record.msg}:{type(exc).__name__}:{getattr(exc, 'errno', '')}"
        if not _once(cause):
            return False
        if exc is not None:
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc}"
            record.args, record.exc_info, record.exc_text = None, None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg = f"{record.msg}{_since(cause)}"
        return True


def quiet_connection_logs() -> None:
    """Install :class:`OncePerCause` on the loggers that report per-connection trouble (idempotent)."""
    for name in ("asyncio", "uvicorn.error"):
        log = logging.getLogger(name)
        if not any(isinstance(f, OncePerCause) for f in log.filters):
            log.addFilter(OncePerCause())


def uvicorn_options(max_connections: int | None, read_timeout_s: float) -> dict[str, Any]:
    """What ``kvforge serve`` and ``kvforge route`` give ``uvicorn.Config`` (with the logs made quiet)."""
    quiet_connection_logs()
    cap = default_max_connections() if max_connections is None else max_connections
    return {"http": protocol_class(cap, read_timeout_s)}
