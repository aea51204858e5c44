"""``/health``, ``/metrics``, ``/v1/models``: what the server is and how it is doing (never waits on the model)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from kvforge.serve import schemas as S
from kvforge.serve.errors import APIError
from kvforge.serve.state import Server, get_server

router = APIRouter()


@router.get("/health")
async def health(server: Server = Depends(get_server)) -> dict[str, Any]:  # noqa: B008
    scheduler, o = server.scheduler, server.options
    return {
        "status": "ok",
        "model": o.model_name,
        "queue_depth": scheduler.depth,
        "busy": scheduler.busy,
        "running": scheduler.num_running,
        "scheduler": "serial" if scheduler.max_running == 1 else "batched",
        "reuse": o.reuse_kind,
        "press": o.press,
        "store": server.features.has_store,
    }


@router.get("/metrics")
async def prometheus(server: Server = Depends(get_server)) -> Response:  # noqa: B008
    return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(server: Server = Depends(get_server)) -> dict[str, Any]:  # noqa: B008
    return {"object": "list", "data": [S.model_card(server.options.model_name)]}


@router.get("/v1/models/{name:path}")
async def model(name: str, server: Server = Depends(get_server)) -> dict[str, Any]:  # noqa: B008
    if name != server.options.model_name:
        raise APIError(404, f"model {name!r} not found", param="model", code="model_not_found")
    return S.model_card(server.options.model_name)
