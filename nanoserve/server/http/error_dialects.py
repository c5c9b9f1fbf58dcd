"""Each API family answers errors in its own clients' dialect.

Every error is first built in the shared shape (nanoserve/server/http/errors.py), by a route, a handler or a
middleware; `ErrorDialects`, an ASGI middleware around all of them, then rewrites it for the family
the path belongs to, so one place decides and nothing that answers an error needs to know:

- OpenAI (`/v1/...`): the shared shape is OpenAI's. An invalid request is 400 (OpenAI and vLLM;
  the openai SDK raises `BadRequestError` for 400 only), an unknown route is 404
  "Invalid URL (METHOD path)".
- TGI (`POST /`, `/generate`, `/generate_stream`, `/tokenize`, `/info`): `{"error": str,
  "error_type": str}` with TGI's status codes (router/src/server.rs: validation 422, overloaded
  429, generation 424, incomplete_generation 500), which TGI's clients map to their exceptions.
- Everything else keeps the shared shape.

A body that is not JSON (Starlette's CORS middleware answers a disallowed preflight in plain text)
is wrapped into the family's shape. Successful responses pass through untouched.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic_core import to_json
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoserve.server.http.errors import error_body

Family = Literal["openai", "tgi", "shared"]

TGI_PATHS = frozenset({"/generate", "/generate_stream", "/tokenize", "/info"})
# 4xx statuses that are not a problem with the request's content: they keep their own error_type.
_NOT_VALIDATION = frozenset({401, 403, 404, 405, 429})


def family(method: str, path: str) -> Family:
    """The API family a request belongs to, by its path (POST / is TGI's; GET / the chat page)."""
    if path == "/v1" or path.startswith("/v1/"):
        return "openai"
    if path in TGI_PATHS or (path == "/" and method not in ("GET", "HEAD")):
        return "tgi"
    return "shared"


def tgi_error(status: int, code: str) -> tuple[int, str]:
    """TGI's (status, error_type) for an error of the shared shape."""
    if code == "generation_error":
        return 424, "generation"
    if code == "incomplete_generation":
        return 500, "incomplete_generation"
    if status == 429:
        return 429, "overloaded"
    if 400 <= status < 500 and status not in _NOT_VALIDATION:
        return status, "validation"
    return status, code


def tgi_error_body(status: int, message: str, code: str) -> tuple[int, dict[str, str]]:
    status, error_type = tgi_error(status, code)
    return status, {"error": message, "error_type": error_type}


def _shared(status: int, body: bytes, content_type: str, method: str) -> dict[str, Any]:
    """The error in the shared shape: parsed when it is one, else wrapped (plain-text bodies)."""
    if "json" in content_type:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return parsed
    text = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}"
    code = "cors_preflight_rejected" if method == "OPTIONS" and status == 400 else f"http_{status}"
    return error_body(status, text, code)


def rewrite(fam: Family, method: str, path: str, status: int, body: bytes,
            content_type: str) -> tuple[int, bytes] | None:
    """The family's (status, JSON body) for an error response; None to send it as it is."""
    shared_json = "json" in content_type
    if fam == "shared" and shared_json:
        return None
    err = _shared(status, body, content_type, method)["error"]
    message, code = str(err.get("message", "")), str(err.get("code") or f"http_{status}")
    if fam == "tgi":
        param = err.get("param")
        if param and str(param) not in message:  # TGI's shape has no `param`: the message names it
            message = f"{param}: {message}"
        status, tgi = tgi_error_body(status, message, code)
        return status, to_json(tgi)
    if fam == "openai":
        if status == 422:
            status = 400
        if status == 404 and code == "not_found":  # no such route: OpenAI's answer, word for word
            unknown = error_body(status, f"Invalid URL ({method} {path})", "unknown_url")
            unknown["error"]["type"] = "invalid_request_error"
            return status, to_json(unknown)
    return status, to_json(error_body(status, message, code, err.get("param")))


class ErrorDialects:
    """ASGI middleware: error responses in the dialect of the path's API family (see the module)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        fam = family(method, path)
        start: Message | None = None
        passing = False
        chunks: list[bytes] = []

        async def send_in_dialect(message: Message) -> None:
            nonlocal start, passing
            if passing:
                await send(message)
                return
            if message["type"] == "http.response.start" and message["status"] < 400:
                passing = True
                await send(message)
                return
            if message["type"] == "http.response.start":
                start = message
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False) or start is None:
                return
            passing = True
            await self._send_rewritten(send, start, b"".join(chunks), fam, method, path)

        await self.app(scope, receive, send_in_dialect)

    @staticmethod
    async def _send_rewritten(send: Send, start: Message, body: bytes, fam: Family, method: str,
                              path: str) -> None:
        headers = [(k, v) for k, v in start.get("headers", [])]
        content_type = next((v.decode("latin-1") for k, v in headers if k.lower() == b"content-type"), "")
        status = int(start["status"])
        new = rewrite(fam, method, path, status, body, content_type.lower())
        if new is not None and method != "HEAD":
            status, body = new
            keep = [(k, v) for k, v in headers if k.lower() not in (b"content-type", b"content-length")]
            headers = [*keep, (b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode())]
        elif new is not None:  # HEAD: the status changes with the dialect; there is no body
            status = new[0]
        await send({**start, "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body if method != "HEAD" else b""})
