"""ASGI middleware: shutdown answers, Bearer API key, request body size limit, per-request counters and latency."""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

from kvforge.errors import UserError
from kvforge.serve.errors import error_body
from kvforge.serve.metrics import Metrics

Scope = dict[str, Any]
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/kv/documents", "/health", "/metrics")
OPEN_PATHS = ("/health", "/metrics")  # no API key needed: probes and scrapers


async def _send_error(
    send: Any, status: int, message: str, code: str, headers: list | None = None, kind: str = "invalid_request_error"
) -> None:
    body = json.dumps(error_body(message, kind, None, code)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())] + (headers or [])
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def check_api_key(key: str | None) -> None:
    """An API key that is set but empty (``KVFORGE_API_KEY=``) is refused: it would start an open server silently."""
    if key is not None and not key.strip():
        raise UserError(
            "the API key is empty (--api-key or KVFORGE_API_KEY): give a key, or unset it for an open server"
        )


class GuardMiddleware:
    """Checks the API key and the body size before the app sees a request, and counts every answer. While the server
    drains after SIGTERM (``app.state.draining``, set by ``kvforge serve``), every new request is answered 503
    ``shutting_down`` with ``Retry-After`` and ``Connection: close``: a client is told, never refused.

    Args:
        api_key: when set, paths other than :data:`OPEN_PATHS` need ``Authorization: Bearer <api_key>`` (else 401).
        max_body_bytes: larger bodies get a 413 (by Content-Length, or while a chunked body streams in).
    """

    def __init__(self, app: Any, metrics: Metrics, api_key: str | None, max_body_bytes: int) -> None:
        check_api_key(api_key)
        self.app = app
        self.metrics = metrics
        self.api_key = api_key
        self._key = None if api_key is None else api_key.strip().encode()  # compared as UTF-8 bytes
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS or path.startswith("/v1/models/") else "other"
        endpoint = "/v1/models" if endpoint.startswith("/v1/models/") else endpoint
        status = {"code": 500}
        start = time.perf_counter()

        async def send_counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if getattr(getattr(scope.get("app"), "state", None), "draining", False):
                await _send_error(
                    send_counted,
                    503,
                    "the server is shutting down; retry on another replica",
                    "shutting_down",
                    [(b"retry-after", b"1"), (b"connection", b"close")],
                    kind="server_error",
                )
                return
            if not self._authorized(scope, path):
                await _send_error(
                    send_counted,
                    401,
                    "invalid or missing API key (Authorization: Bearer <key>)",
                    "invalid_api_key",
                    [(b"www-authenticate", b"Bearer")],
                )
                return
            headers = dict(scope.get("headers") or [])
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                await _send_error(
                    send_counted, 413, f"request body over {self.max_body_bytes} bytes", "request_too_large"
                )
                return
            await self._call_limited(scope, receive, send_counted, length is not None)
        finally:
            code = status["code"]
            self.metrics.requests.labels(endpoint, str(code)).inc()
            if code >= 400:
                self.metrics.errors.labels(endpoint, str(code)).inc()
            if endpoint in ("/v1/completions", "/v1/chat/completions") and code < 400:
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    def _authorized(self, scope: Scope, path: str) -> bool:
        if self.api_key is None or path in OPEN_PATHS:
            return True
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")  # bytes as sent: a UTF-8 key matches
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key or b"")

    async def _call_limited(self, scope: Scope, receive: Any, send: Any, has_length: bool) -> None:
        """Call the app; a body without Content-Length (chunked) is read here first, up to the limit."""
        if has_length or scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # client gone
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await _send_error(send, 413, f"request body over {self.max_body_bytes} bytes", "request_too_large")
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # type: ignore[no-any-return]

        await self.app(scope, replay, send)
