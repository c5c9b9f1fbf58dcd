"""The app in-process: httpx against the ASGI app with its lifespan run (engine loaded, warmed up).

    async with asgi_client(tiny_checkpoint, max_seqs=2) as client:
        r = await client.post("/generate", json={"inputs": "Hi"})

Keyword arguments are Settings fields (device is cpu unless given). `client.app` is the FastAPI app.
For sockets, streaming to a real client, disconnects and signals use tests/server/server.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from nanoserve.server.app import create_app
from nanoserve.server.settings import Settings


class AppClient(httpx.AsyncClient):
    app: Any


@asynccontextmanager
async def asgi_client(checkpoint: Path | str, **settings: Any) -> AsyncIterator[AppClient]:
    app = create_app(Settings(checkpoint=Path(checkpoint), **{"device": "cpu", **settings}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AppClient(transport=transport, base_url="http://testserver") as client:
            client.app = app
            yield client
