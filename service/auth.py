"""Optional API keys: `Authorization: Bearer <key>`, compared in constant time.

With no keys configured every route is open. With keys, every route requires one except the
probes (`/health`, `/ready`), `/metrics` unless `metrics_require_auth` is set, and the static chat
page at `GET /` and its `/static/` files (no data; its API calls carry the key the user types in).
The dependency is installed app-wide in `create_app`, so routers added later are covered too.
Keys are never logged: settings hold them as `SecretStr` and failures do not echo the header.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.errors import APIError
from service.settings import Settings

PUBLIC_ROUTES = frozenset({("GET", "/health"), ("GET", "/ready"), ("GET", "/"), ("GET", "/static/{name}")})
METRICS_ROUTE = ("GET", "/metrics")

_bearer = HTTPBearer(auto_error=False, description="One of the server's API keys (if any are set).")


def key_matches(candidate: str, keys: list[bytes]) -> bool:
    """Constant-time comparison against every key (no early exit that would leak which one)."""
    given = candidate.encode("utf-8", "surrogatepass")
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


def is_public(request: Request, settings: Settings) -> bool:
    route = request.scope.get("route")
    path = getattr(route, "path", request.url.path)
    method = "GET" if request.method == "HEAD" else request.method
    if (method, path) in PUBLIC_ROUTES:
        return True
    return (method, path) == METRICS_ROUTE and not settings.metrics_require_auth


async def require_api_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """401 unless the request carries a configured API key (or the route is public)."""
    settings: Settings = request.app.state.settings
    keys = request.app.state.api_keys
    if not keys or is_public(request, settings):
        return
    challenge = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise APIError(401, "missing API key: send `Authorization: Bearer <key>`", code="missing_api_key",
                       headers=challenge)
    if not key_matches(credentials.credentials, keys):
        raise APIError(401, "invalid API key", code="invalid_api_key", headers=challenge)
