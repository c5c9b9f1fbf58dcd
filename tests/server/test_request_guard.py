"""The body-time limit (408) of BodyLimitMiddleware, on its own: a scripted client and app."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import Message

from nanoserve.server.http.errors import APIError
from nanoserve.server.http.request_guard import BodyLimitMiddleware


class Client:
    """The ASGI receive side: body pieces with pauses, then (like uvicorn) nothing until the
    client disconnects."""

    def __init__(self, pieces: list[tuple[float, bytes]]) -> None:
        self.pieces = list(pieces)

    async def receive(self) -> Message:
        if not self.pieces:
            await asyncio.sleep(3600)  # waiting for a disconnect that does not come
        pause, body = self.pieces.pop(0)
        await asyncio.sleep(pause)
        return {"type": "http.request", "body": body, "more_body": bool(self.pieces)}


async def run(pieces: list[tuple[float, bytes]], timeout_s: float, after_body_s: float = 0.0) -> Any:
    """Run an app that reads the whole body, then keeps listening for a disconnect for
    `after_body_s` (as the routes do while they generate); returns what it got or raised."""
    sent: list[Message] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message["body"]
            if not message["more_body"]:
                break
        try:
            async with asyncio.timeout(after_body_s):
                await receive()
        except TimeoutError:
            pass
        await send({"type": "http.response.body", "body": body})

    async def send(message: Message) -> None:
        sent.append(message)

    guard = BodyLimitMiddleware(app, max_bytes=1 << 20, timeout_s=timeout_s)
    try:
        await guard({"type": "http", "headers": []}, Client(pieces).receive, send)
    except APIError as exc:
        return exc
    return sent[0]["body"]


async def test_a_body_that_stops_arriving_is_refused_when_its_time_is_up() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    exc = await run([(0.0, b'{"inp'), (30.0, b'uts": "x"}')], timeout_s=0.3)
    assert isinstance(exc, APIError) and (exc.status_code, exc.code) == (408, "body_timeout")
    assert "0.3 s" in exc.message and exc.headers == {"Connection": "close"}
    assert loop.time() - start < 5  # at the deadline, not when the client would have finished


async def test_a_trickle_is_refused_even_when_every_piece_comes_in_time() -> None:
    # The limit is on the whole body, not on the gap between pieces.
    exc = await run([(0.1, b"x")] * 10, timeout_s=0.5)
    assert isinstance(exc, APIError) and exc.status_code == 408


async def test_a_body_complete_in_time_is_served_and_waiting_afterwards_is_not_limited() -> None:
    body = json.dumps({"inputs": "Hello"}).encode()
    got = await run([(0.05, body[:4]), (0.05, body[4:])], timeout_s=0.4, after_body_s=0.8)
    assert got == body  # the app then listened past the deadline without a 408
