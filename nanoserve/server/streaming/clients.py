"""Who a request comes from, for fair admission and per-client queue shares
(nanoserve/server/streaming/encoding.py and the engine's WaitingQueue).

With API keys the client is its key (hashed: the key itself never leaves nanoserve/server/http/auth.py's
comparison). Without keys it is the peer's address, or the value of `client_id_header` when an
operator's trusted proxy sets one (behind a proxy every peer address is the proxy's).
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request

from nanoserve.server.settings import Settings

MAX_ID_CHARS = 128


def client_id(request: Request) -> str:
    """The request's client (worked out once; the chat route asks before the prompt is rendered)."""
    known = getattr(request.state, "client_id", None)
    if known is None:
        known = request.state.client_id = _client_id(request)
    return str(known)


def _client_id(request: Request) -> str:
    settings: Settings = request.app.state.settings
    if request.app.state.api_keys:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token:
            digest = hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).hexdigest()
            return "key:" + digest[:16]
    if settings.client_id_header:
        value = request.headers.get(settings.client_id_header, "")
        # X-Forwarded-For lists the original client first, then each proxy it went through.
        first = value.split(",", 1)[0].strip()
        if first:
            return "hdr:" + first[:MAX_ID_CHARS]
    peer = request.client
    return "ip:" + (peer.host if peer is not None else "unknown")
