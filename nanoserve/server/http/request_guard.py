"""Limits applied before a route runs: header size (431), body size (413), body time (408) and
draining (503).

All are ASGI middleware rather than dependencies so they cover every route, including the ones
other modules add, and so an over-long or trickling body is refused while it streams in, not after
buffering it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoserve.server.http.errors import APIError, error_response

# Probes and scrapes keep answering while the server drains.
ALWAYS_OPEN = frozenset({"/health", "/ready", "/metrics"})


class HeaderLimitMiddleware:
    """Refuse requests whose headers are too many or too large in total with 431.

    uvicorn's default parser accepts headers of any size and number, so without this a client could
    make every request hold megabytes of header memory.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, max_count: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_count = max_count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope.get("headers", [])
            size = sum(len(k) + len(v) + 4 for k, v in headers)  # "name: value\r\n"
            problem = None
            if len(headers) > self.max_count:
                problem = f"request has {len(headers)} headers, more than the limit of {self.max_count}"
            elif size > self.max_bytes:
                problem = f"request headers total {size} bytes, more than the limit of {self.max_bytes}"
            if problem is not None:
                response = error_response(431, problem, code="headers_too_large",
                                          headers={"Connection": "close"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse a request body larger than `max_bytes` (413) or not complete `timeout_s` seconds
    after the request's headers arrived (408).

    The size is checked against Content-Length first and counted as the body arrives. The time
    limit is what a reverse proxy's body read timeout does: without it a client that sends
    headers and then a byte now and then holds a connection, and an in-flight request in the
    metrics, for as long as it likes. Once the body is complete, later receives (the routes wait
    on them to see a client disconnect) have no deadline.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds the server's limit of {self.max_bytes} bytes",
                        code="body_too_large")

    def _too_slow(self) -> APIError:
        return APIError(408, f"the request body was not complete within {self.timeout_s:g} s",
                        code="body_timeout", headers={"Connection": "close"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope.get("headers", []):
            if key.lower() == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                exc = self._too_large()
                await error_response(413, exc.message, code=exc.code)(scope, receive, send)
                return
        seen = 0
        complete = False
        # On the event loop's clock, from when the headers were parsed (this middleware runs then).
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout_s is None else loop.time() + self.timeout_s
        # One timer per request, armed at the first read of an incomplete body, that cancels a
        # read still waiting when the time is up. (asyncio.wait_for around each read ran it in a
        # task of its own: ~16 us per read against ~0.5, on every request with a body.)
        timer: asyncio.TimerHandle | None = None
        reading: asyncio.Task[Any] | None = None  # the task waiting in a body read, if one is
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            if reading is not None:
                reading.cancel()

        async def counting_receive() -> Message:
            nonlocal seen, complete, timer, reading
            if complete or deadline is None:
                message = await receive()
            else:
                if expired:
                    raise self._too_slow()
                if timer is None:
                    timer = loop.call_at(deadline, expire)
                reading = asyncio.current_task()
                try:
                    message = await receive()
                except asyncio.CancelledError:
                    if not expired:
                        raise
                    # The cancellation was the timer's: undo it (3.11+ counts them), answer 408.
                    # Raised inside FastAPI's body parsing, as the 413 below.
                    uncancel = getattr(reading, "uncancel", None)
                    if uncancel is not None:
                        uncancel()
                    raise self._too_slow() from None
                finally:
                    reading = None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if not complete and not message.get("more_body", False):
                    complete = True
                    if timer is not None:
                        timer.cancel()
                if seen > self.max_bytes:
                    # Raised inside FastAPI's body parsing, which re-raises HTTPExceptions as they are.
                    raise self._too_large()
            return message

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if timer is not None:
                timer.cancel()


DRAINING_MESSAGE = "the server is shutting down"
DRAINING_HEADERS = {"Retry-After": "1", "Connection": "close"}


class DrainGate:
    """While draining, everything but probes and metrics gets 503 + Retry-After.

    That includes a request that arrived before the drain but whose body is still coming in: it
    has not been admitted, so its next body read answers the same 503 (the server wakes such reads
    when the drain begins: `NanoserveHttpProtocol.wake_body_reader`). Left waiting, it would be
    cancelled when the server stops, a 500 with a traceback.
    """

    def __init__(self, app: ASGIApp, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self.is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] not in ALWAYS_OPEN and self.is_draining():
            response = error_response(503, DRAINING_MESSAGE, code="draining", headers=DRAINING_HEADERS)
            await response(scope, receive, send)
            return
        body_complete = False

        async def receive_unless_draining() -> Message:
            nonlocal body_complete
            message = await receive()
            if not body_complete and message["type"] == "http.request":
                body_complete = not message.get("more_body", False)
                if self.is_draining() and scope["path"] not in ALWAYS_OPEN:
                    # Raised inside FastAPI's body parsing, as BodyLimitMiddleware's 413.
                    raise APIError(503, DRAINING_MESSAGE, code="draining", headers=DRAINING_HEADERS)
            return message

        await self.app(scope, receive_unless_draining, send)
