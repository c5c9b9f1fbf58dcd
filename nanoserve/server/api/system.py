"""Probes and the metrics scrape: GET /health, GET /ready, GET /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nanoserve.server.api.common import error_responses
from nanoserve.server.http.errors import error_response

router = APIRouter(tags=["system"])


def _probe_doc(ok: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"description": ok}, **error_responses(503)}


@router.get("/health", responses=_probe_doc("The process and the engine thread are alive."))
async def health(request: Request) -> Response:
    """Liveness: the process answers and every served model's engine thread is alive."""
    engine = request.app.state.engine
    if engine is not None and not engine.health():
        return error_response(503, "the engine thread is not running", code="engine_dead")
    for served in request.app.state.registry:
        if not served.engine.health():
            return error_response(503, f"the engine thread of model {served.name!r} is not running",
                                  code="engine_dead")
    # Still loading is alive: restarting a process that is loading its checkpoint helps no one.
    return JSONResponse({"status": "ok"})


@router.get("/ready", responses=_probe_doc("Loaded, warmed up and accepting requests."))
async def ready(request: Request) -> Response:
    """Readiness: checkpoint loaded and warmed up, not draining (503 otherwise)."""
    retry = {"Retry-After": "1"}
    if request.app.state.lifecycle.draining:
        return error_response(503, "the server is shutting down", code="draining", headers=retry)
    engine = request.app.state.engine
    if engine is None or not engine.ready:
        return error_response(503, "the model is not loaded yet", code="not_ready", headers=retry)
    return JSONResponse({"status": "ready"})


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"description": "Prometheus text format.", "content": {"text/plain": {}}}},
)
async def metrics(request: Request) -> Response:
    """Prometheus metrics (text exposition format)."""
    body, content_type = request.app.state.metrics.render()
    return Response(body, media_type=content_type)
