"""POST /admin/reload: reload the checkpoints whose files changed (behind the API key when keys are set)."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from nanoserve.engine.types import NotReady
from nanoserve.server.api.common import error_responses
from nanoserve.server.models.reload import Reloader

router = APIRouter(tags=["system"])


class ReloadEntry(BaseModel):
    model: str
    result: str = Field(description="reloaded, unchanged, or failed (the previous version still serves).")
    version: str = Field(description="The version serving now: sha256:<12 hex>@step<N>.")
    previous: str | None = Field(None, description="The version replaced, when reloaded.")
    error: str | None = Field(None, description="Why the files on disk are not served, when failed.")


class ReloadResponse(BaseModel):
    models: list[ReloadEntry]


@router.post("/admin/reload", response_model=ReloadResponse,
             responses=error_responses(401, 503))
async def reload_models(request: Request) -> ReloadResponse:
    """Reload every served checkpoint whose files changed; in-flight requests finish on the old weights."""
    reloader: Reloader | None = request.app.state.reloader
    if reloader is None:
        raise NotReady("the models are not loaded yet")
    results = await reloader.reload()
    return ReloadResponse(models=[ReloadEntry(**asdict(r)) for r in results])
