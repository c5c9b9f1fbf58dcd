"""Typed FastAPI dependencies every route uses: the running engine and the settings."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

from fastapi import Depends, Request

from nanoserve.engine.engine import Engine
from nanoserve.engine.types import NotReady
from nanoserve.server.settings import Settings


# Both are `async def` although they never await: FastAPI runs a plain `def` dependency in its
# thread pool, a thread hop per request each (measured: 17% of the event loop's time serving
# 2-token streams).
async def get_engine(request: Request) -> Engine:
    """The running engine; 503 while it is loading or after shutdown."""
    engine: Engine | None = request.app.state.engine
    if engine is None:
        raise NotReady("the model is not loaded yet")
    return engine


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def server_version() -> str:
    try:
        return version("nanoserve")
    except PackageNotFoundError:
        return "0+unknown"
