"""``/health`` (the upstream's, as the router reaches it) and ``/metrics`` (the router's own series)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from kvforge.route.state import UPSTREAM_ERRORS, Router, get_router

router = APIRouter()


@router.get("/health")
async def health(state: Router = Depends(get_router)) -> Response:  # noqa: B008
    assert state.client is not None
    try:
        answer = await state.client.get("/health", timeout=5.0)
        ok = answer.status_code == 200
    except UPSTREAM_ERRORS:
        ok = False
    body = {"status": "ok" if ok else "upstream unavailable", "upstream": state.shown}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def prometheus(state: Router = Depends(get_router)) -> Response:  # noqa: B008
    return Response(generate_latest(state.metrics.registry), media_type="text/plain; version=0.0.4")
