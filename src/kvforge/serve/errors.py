"""OpenAI-style error bodies ``{"error": {"message", "type", "param", "code"}}`` and the handlers that make them.

Every failure a client can cause maps to a 4xx; an unexpected exception is logged and answered with a 500 in the same
shape (the server keeps serving).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvforge.errors import StoreUnavailableError, UserError

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def user_error(e: UserError, param: str | None = None) -> APIError:
    """A :class:`UserError` from the library (unknown press, prompt too long...) as a 400."""
    if isinstance(e, StoreUnavailableError):  # never describe a store (its URL, host, error) to an API client
        return store_unavailable()
    message = str(e)
    code = "context_length_exceeded" if "exceeds the model's context" in message else None
    return APIError(400, message, param=param, code=code)


def store_unavailable(message: str = "store unavailable") -> APIError:
    """503 ``store_unavailable``: where a request needs its KV stored and the store cannot keep it (the message
    never describes the store: no URL, host or error)."""
    return APIError(503, message, type="store_unavailable", code="store_unavailable", headers={"Retry-After": "5"})


def stored_or_503(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)``, whose store writes must all be kept somewhere: a write the store skipped (Redis down,
    a full or read-only disk, an entry over ``max_bytes``) makes it a 503, never a 200 that names what was not
    stored. Entries already stored (nothing to write) are fine."""
    from kvforge.store import track_writes

    with track_writes() as writes:
        out = fn(*args, **kwargs)
    if writes.lost:
        raise store_unavailable(
            f"the KV store did not keep {len(writes.lost)} of the {len(writes.lost) + len(writes.stored)} entries "
            "to write (unavailable, full or read-only): nothing is guaranteed stored; retry later"
        )
    return out


def timeout_error(timeout_s: float) -> APIError:
    return APIError(504, f"request timed out after {timeout_s}s", type="timeout", code="timeout")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None, None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"invalid JSON in the request body: {first.get('ctx', {}).get('error', 'cannot parse')}", None, None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "missing" and not loc:
        return "the request body must be a JSON object", None, None
    # union members add their type name to the location ("prompt.str"): keep field names only
    param = ".".join(p for p in loc if p.isidentifier() and p not in _TYPE_NAMES) or None
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    if first.get("type") == "extra_forbidden":
        return f"unsupported field {param!r}: kvforge does not implement it{more}", param, "unsupported_field"
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}{more}", param, first.get("type")


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "function-after", "literal_error"}


def install_handlers(app: FastAPI) -> None:
    """Make every error an OpenAI-style body: validation -> 400, HTTP errors keep their status, others -> 500."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(UserError)
    async def _user_error(request: Request, exc: UserError) -> JSONResponse:
        return user_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param, code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), kind), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)
