"""HTTP request metrics as a pure ASGI middleware.

Pure ASGI rather than `BaseHTTPMiddleware`, which runs the endpoint in another task and re-wraps
streamed bodies (it gets in the way of disconnect handling). Here a request is timed until the app
returns, i.e. until the last byte of a stream is sent, and the status is the one actually sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoserve.server.metrics.instruments import Instruments

UNMATCHED_ROUTE = "unmatched"  # 404s share one label value: scanners must not create new series
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def arrival_time(scope: Scope) -> float:
    """`request.state.arrival` (time.perf_counter() when the request arrived), set once per request.

    Whichever middleware sees the request first sets it; everything that measures "from arrival"
    (TTFT, queue time, end-to-end duration) reads the same value.
    """
    state: dict[str, Any] = scope.setdefault("state", {})
    return float(state.setdefault("arrival", time.perf_counter()))


def leaf_routes(routes: Iterable[BaseRoute]) -> Iterator[BaseRoute]:
    """The routes to match against, with FastAPI's lazily included routers opened up.

    Recent FastAPI keeps `include_router(...)` as one `_IncludedRouter` entry (no `path`) holding the
    original router; without a prefix its routes match the request path as they are. Anything else is
    matched as a whole (and falls back to the route the router records in the scope).
    """
    for route in routes:
        inner = getattr(route, "original_router", None)
        prefix = getattr(getattr(route, "include_context", None), "prefix", None)
        if inner is not None and prefix == "":
            yield from leaf_routes(inner.routes)
        else:
            yield route


def match_route(routes: Iterable[BaseRoute], scope: Scope) -> str | None:
    """The path template the router will pick (`/v1/models`, not a raw URL), the way Starlette does."""
    partial = None
    for route in leaf_routes(routes):
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return getattr(route, "path", None)
        if match is Match.PARTIAL and partial is None:
            partial = route  # e.g. the right path with the wrong method: answered with a 405
    return getattr(partial, "path", None)


class RouteTemplates:
    """`match_route` for a middleware, remembering the answer for paths that are a template
    themselves (`/generate`, not `/v1/models/{model_id}`): matching walked every route's regex per
    request, ~5% of the event loop's time per request. Only the app's own templates are kept, so
    requests for made-up paths cannot grow it."""

    def __init__(self, routes: list[BaseRoute]) -> None:
        self._routes = routes
        self._static: dict[tuple[str, str, str], str] = {}

    def __call__(self, scope: Scope) -> str | None:
        key = (scope["method"], scope.get("root_path", ""), scope["path"])
        template = self._static.get(key)
        if template is None:
            template = match_route(self._routes, scope)
            if template is not None and template == scope["path"]:
                self._static[key] = template
        return template

    def __len__(self) -> int:
        return len(self._static)


def routed_template(scope: Scope) -> str | None:
    """The template of the route the router chose (Starlette and FastAPI record it in the scope)."""
    return getattr(scope.get("route"), "path", None)


class HTTPMetricsMiddleware:
    """Counts requests by route/method/status, tracks in-flight requests, times them from arrival."""

    def __init__(self, app: ASGIApp, instruments: Instruments, routes: list[BaseRoute]) -> None:
        self.app = app
        self._m = instruments
        self._templates = RouteTemplates(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival = arrival_time(scope)
        # Known before the app runs, for the in-flight gauge; requests a middleware answers
        # (503 while draining, 413) never reach the router, so this is also their label.
        planned = self._templates(scope) or UNMATCHED_ROUTE
        method = scope["method"] if scope["method"] in _METHODS else "other"
        status: int | None = None

        async def send_recording_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        in_flight = self._m.http_in_flight.labels(route=planned)
        in_flight.inc()
        code = "500"  # an exception before any response reaches the server-error handler: a 500
        try:
            await self.app(scope, receive, send_recording_status)
        except asyncio.CancelledError:
            code = "499"  # nginx's "client closed request": cancelled before a status was sent
            raise
        finally:
            in_flight.dec()
            if status is not None:
                code = str(status)
            route = routed_template(scope) or planned
            self._m.http_requests.labels(route=route, method=method, code=code).inc()
            self._m.http_duration.labels(route=route).observe(time.perf_counter() - arrival)
