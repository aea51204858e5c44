"""Connections under abuse (:mod:`kvforge.serve.connections`), on a real uvicorn server in this process: half-sent
requests get a 408 after the read timeout, a stalled body is cut, connections past the cap get a 503 at once, and
each cause is one warning, never a traceback per connection."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest

uvicorn = pytest.importorskip("uvicorn")

from kvforge.serve import connections  # noqa: E402

TIMEOUT_S = 0.5


async def _app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server(caplog: pytest.LogCaptureFixture) -> Iterator[int]:
    connections._seen.clear()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = connections.uvicorn_options(max_connections=4, read_timeout_s=TIMEOUT_S)
    config = uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", **options)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    caplog.set_level(logging.WARNING)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield port
    srv.should_exit = True
    thread.join(10)


def _connect(port: int, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=15)
    if data:
        s.sendall(data)
    return s


def _answer(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_half_sent_requests_get_a_408_and_one_warning(server: int, caplog: pytest.LogCaptureFixture) -> None:
    halves = [_connect(server, b"GET / HTTP/1.1\r\nHost: a\r\n") for _ in range(3)]
    start = time.monotonic()
    for s in halves:
        assert _answer(s).startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - start < 10  # closed by the timeout, not by the client
    silent = _connect(server)  # a connection that never sends a byte is closed too
    assert _answer(silent).startswith(b"HTTP/1.1 408 ")
    assert sum("did not arrive" in r.getMessage() for r in caplog.records) == 1
    assert "Traceback" not in caplog.text
    with _connect(server, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n") as ok:
        assert _answer(ok).startswith(b"HTTP/1.1 200 ")


def test_a_stalled_body_is_cut(server: int) -> None:
    s = _connect(server, b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n0123")
    assert _answer(s) == b""  # closed: the app saw a disconnect


def test_connections_past_the_cap_get_a_503_at_once(server: int, caplog: pytest.LogCaptureFixture) -> None:
    held = [_connect(server) for _ in range(4)]
    time.sleep(0.1)
    extra = [_connect(server) for _ in range(3)]
    for s in extra:  # a 503, not the 408 of the read timeout: refused on arrival (no timing asserted: CI is loaded)
        assert _answer(s).startswith(b"HTTP/1.1 503 ")
    assert sum("open connections" in r.getMessage() for r in caplog.records) == 1
    for s in held:
        s.close()


def test_per_connection_tracebacks_become_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    connections._seen.clear()
    connections.quiet_connection_logs()
    log = logging.getLogger("asyncio")
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                log.error("socket.accept() out of system resource", exc_info=True)
    records = [r for r in caplog.records if r.name == "asyncio"]
    assert len(records) == 1 and records[0].exc_info is None and "Too many open files" in records[0].getMessage()
