"""Optional API keys: `Authorization: Bearer <key>`, compared in constant time.

With no keys configured every route is open. With keys, every request needs one except these,
which carry no data and no generation:
- the probes `/health` and `/ready` (an orchestrator has no key);
- `/metrics`, unless `metrics_require_auth` is set (a scraper may have none);
- the chat page `GET /` and its `/static/` files (the page's API calls carry the key its user
  types in);
- the API's description: `/openapi.json`, `/docs` and `/redoc` (they describe the routes and
  hold nothing a key protects; Swagger UI's "Authorize" then takes a key for its calls).
Those are open for GET and HEAD only. Anything else, an unknown path included, is 401 without a
valid key, so a route's existence is not disclosed to callers without one.

The check is an ASGI middleware (`ApiKeyGate`) outside the body's limits, so it runs before
anything reads the request's body or judges its size: a caller without a key gets 401, never a 413
or a 422 about a body it should not have been able to send. `require_api_key` only declares the
scheme in the OpenAPI document.
Keys are never logged: settings hold them as `SecretStr` and failures do not echo the header.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Receive, Scope, Send

from nanoserve.server.http.errors import error_response

PUBLIC_PATHS = frozenset({"/health", "/ready", "/", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                          "/redoc"})
PUBLIC_PREFIXES = ("/static/",)
METRICS_PATH = "/metrics"
READ_METHODS = frozenset({"GET", "HEAD"})

_bearer = HTTPBearer(auto_error=False, description="One of the server's API keys (if any are set).")


def key_matches(candidate: str, keys: list[bytes]) -> bool:
    """Constant-time comparison against every key (no early exit that would leak which one)."""
    given = candidate.encode("utf-8", "surrogatepass")
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


def is_public(method: str, path: str, metrics_require_auth: bool) -> bool:
    if method not in READ_METHODS:
        return False
    if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
        return True
    return path == METRICS_PATH and not metrics_require_auth


def bearer_token(authorization: bytes | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.decode("latin-1").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class ApiKeyGate:
    """401 before the route (and its body parsing) unless the request is public or has a key."""

    def __init__(self, app: ASGIApp, keys: list[bytes], metrics_require_auth: bool) -> None:
        self.app = app
        self.keys = keys
        self.metrics_require_auth = metrics_require_auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_public(scope["method"], scope["path"], self.metrics_require_auth):
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", []) if k.lower() == b"authorization"), None)
        token = bearer_token(header)
        challenge = {"WWW-Authenticate": "Bearer"}
        if token is None:
            response = error_response(401, "missing API key: send `Authorization: Bearer <key>`",
                                      code="missing_api_key", headers=challenge)
        elif not key_matches(token, self.keys):
            response = error_response(401, "invalid API key", code="invalid_api_key", headers=challenge)
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


async def require_api_key(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Declares the bearer scheme in the OpenAPI document; ApiKeyGate has already enforced it."""
