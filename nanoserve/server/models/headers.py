"""Each response of a request that resolved a model names it and its version:
`X-Nanoserve-Model` and `X-Nanoserve-Model-Version` (sha256:<12 hex>@step<N>)."""

from __future__ import annotations

from urllib.parse import quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MODEL_HEADER = "X-Nanoserve-Model"
VERSION_HEADER = "X-Nanoserve-Model-Version"
# The request header that picks a model on the TGI routes (the OpenAI routes read the body's `model`).
MODEL_REQUEST_HEADER = "X-Model"


class ModelHeaders:
    """Adds the headers when a route's engine dependency recorded the model (request.state)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, _naming_model(scope, send) if scope["type"] == "http" else send)


def _naming_model(scope: Scope, send: Send) -> Send:
    async def send_with_model(message: Message) -> None:
        served = (scope.get("state") or {}).get("served_model")
        if message["type"] == "http.response.start" and served is not None:
            name, version = served
            message = {**message, "headers": [
                *message.get("headers", []),
                (MODEL_HEADER.lower().encode(), quote(name, safe="@:+/ ").encode()),
                (VERSION_HEADER.lower().encode(), version.encode()),
            ]}
        await send(message)

    return send_with_model
