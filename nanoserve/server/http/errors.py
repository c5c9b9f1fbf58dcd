"""One JSON error shape for every failure: `{"error": {"message", "type", "code", "param"}}`.

`type` is the class of problem (OpenAI's vocabulary, so SDKs map it to their exceptions), `code` is
the precise machine-readable reason, `param` names the offending field (dotted path) when there is
one. Validation errors are 422 and name the field; nothing ever answers with a traceback.
nanoserve/server/http/error_dialects.py then answers each API family in its own clients' dialect
(TGI's shape on the TGI routes, 400 for invalid requests on /v1).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from nanoserve.engine.types import EngineError, InvalidRequest, NotReady, Overloaded

log = logging.getLogger("nanoserve.errors")

# HTTP status -> OpenAI-style error type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(StarletteHTTPException):
    """An error a route or middleware raises to answer with the shared shape.

    It subclasses Starlette's HTTPException so FastAPI re-raises it untouched even from inside
    request-body parsing (the body-size limit trips there).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(status_code=status, detail=message, headers=dict(headers or {}))
        self.message = message
        self.code = code
        self.param = param


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "code": code,
                  "param": param}
    }


def error_response(
    status: int,
    message: str,
    *,
    code: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def engine_error(exc: EngineError) -> APIError:
    """The HTTP form of an error `Engine.generate` raised before the first token."""
    if isinstance(exc, Overloaded):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return APIError(429, str(exc), code=exc.code, headers={"Retry-After": retry})
    if isinstance(exc, NotReady):
        return APIError(503, str(exc), code=exc.code, headers={"Retry-After": "1"})
    if isinstance(exc, InvalidRequest):
        return APIError(422, str(exc), code=exc.code, param=exc.param)
    return APIError(500, str(exc) or "the engine failed", code=exc.code)


def _dotted(loc: Sequence[Any]) -> str:
    # ("body", "parameters", "stop", 2) -> "parameters.stop[2]"; the "body" prefix is noise to users.
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def validation_error(exc: RequestValidationError, request: Request) -> JSONResponse:
    errors = list(exc.errors())
    content_type = request.headers.get("content-type", "")
    not_json = request.method in {"POST", "PUT", "PATCH"} and "json" not in content_type.lower()
    # FastAPI leaves a non-JSON body unparsed, so it fails as a whole ("body") or as missing fields.
    if not_json and errors and all(
        tuple(e.get("loc", ())) in {("body",), ()} or e.get("type") == "missing" for e in errors
    ):
        shown = content_type or "none"
        return error_response(
            415, f"the request body must be JSON (Content-Type: application/json); got {shown}",
            code="unsupported_media_type",
        )
    first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid", "type": "invalid"}
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "malformed JSON")
        return error_response(422, f"the request body is not valid JSON: {reason}", code="json_invalid")
    messages = []
    for err in errors[:5]:
        where = _dotted(err.get("loc", ())) or "body"
        messages.append(f"{where}: {err.get('msg', 'invalid value')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return error_response(
        422, "; ".join(messages) + more, code=str(first.get("type", "invalid_value")),
        param=_dotted(first.get("loc", ())) or None,
    )


def _allowed_methods(request: Request) -> str:
    """Every method any route serves at this path. Starlette's own `Allow` names only the first
    route's, which is wrong where two routers share a path (GET / is the chat page, POST / TGI's)."""
    methods: set[str] = set()
    for template, operations in request.app.openapi().get("paths", {}).items():
        if compile_path(template)[0].match(request.url.path):
            methods.update(m.upper() for m in operations)
    return ", ".join(sorted(methods))


def _with_request_id(request: Request, headers: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(headers or {})
    request_id = getattr(request.state, "request_id", None)
    if request_id:
        out["X-Request-Id"] = request_id
    return out


def install_error_handlers(app: FastAPI) -> None:
    """Route every error FastAPI/Starlette can produce through the shared shape."""

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc, request)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if isinstance(exc, APIError):
            return error_response(exc.status_code, exc.message, code=exc.code, param=exc.param,
                                  headers=exc.headers)
        cause = exc.__cause__
        if isinstance(cause, UnicodeDecodeError):  # FastAPI's bare "error parsing the body"
            return error_response(
                400, f"the request body is not valid UTF-8 (byte {cause.start}: {cause.reason})",
                code="invalid_utf8",
            )
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
        return error_response(exc.status_code, str(exc.detail), code=code, headers=headers)

    async def on_engine(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EngineError)
        return await on_http(request, engine_error(exc))

    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        # The one place an unexpected exception surfaces: log it with the request id, answer cleanly.
        request_id = getattr(request.state, "request_id", "-")
        log.error("unhandled error in request %s %s (id %s)", request.method, request.url.path, request_id,
                  exc_info=exc)
        response = error_response(
            500, f"internal server error (request id {request_id})", code="internal_error",
            headers=_with_request_id(request, None),
        )
        # This handler runs outside every middleware (Starlette's ServerErrorMiddleware), so the
        # API family's dialect is applied here. (Imported here: error_dialects builds on this module.)
        from nanoserve.server.http.error_dialects import family, rewrite

        fam = family(request.method, request.url.path)
        path = request.url.path
        dialect = rewrite(fam, request.method, path, 500, bytes(response.body), "application/json")
        if dialect is not None:
            response = JSONResponse(json.loads(dialect[1]), status_code=dialect[0],
                                    headers=_with_request_id(request, None))
        return response

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(EngineError, on_engine)
    app.add_exception_handler(Exception, on_crash)
