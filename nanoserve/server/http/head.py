"""HEAD on a GET route: the GET's status and headers, no body (RFC 9110 9.3.2).

FastAPI registers GET routes for GET alone, so without this HEAD /health is 405 and a load
balancer or uptime checker that probes with HEAD marks a healthy server down. The route runs as
a GET; its body is dropped here, with Content-Length left as the GET's.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadAsGet:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        ended = False

        async def send_head(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                await send(message)
            elif message["type"] == "http.response.body" and not ended:
                if not message.get("more_body", False):
                    ended = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_head)
