"""The OpenAPI document, completed where FastAPI cannot infer it from the routes.

- Every operation lists the errors the middleware and dependencies can answer with, in its API
  family's shape (nanoserve/server/http/error_dialects.py): 400/413/415/422 where there is a
  body (400, not 422, on /v1), 401 when API keys are on, 503 everywhere
  but /metrics (draining / not loaded), 429 on generation routes, 500 anywhere.
- Streaming responses are `text/event-stream` with an `itemSchema` per event (OpenAPI 3.2's way,
  which tools such as schemathesis read on 3.1 too); the event payload models are added to the
  components so `sse_response_doc` can reference them.
- With API keys on, the probes (and /metrics unless it needs a key) are documented as public.

`install_docs_page` serves GET /docs, Swagger UI over that document, from files vendored in
nanoserve/server/static/swagger-ui/ (FastAPI's own page loads them from a CDN, so it is blank on a
machine with no network).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel

from nanoserve.server.api.common import ErrorResponse
from nanoserve.server.api.tgi.schemas import TGIErrorResponse
from nanoserve.server.http.auth import METRICS_PATH, is_public
from nanoserve.server.http.error_dialects import family

# Models that only appear inside event streams; registered by the modules that stream them.
SSE_MODELS: dict[str, type[BaseModel]] = {}
_BODY_ERRORS = {400: "Body is not UTF-8.", 413: "Request body too large.", 415: "Body is not JSON.",
                422: "Invalid request (the message names the field)."}
_ERROR_REF = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
_TGI_ERROR_REF = {"application/json": {"schema": {"$ref": "#/components/schemas/TGIErrorResponse"}}}


def sse_response_doc(description: str, model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI for a 200 that is an event stream whose `data:` fields are JSON `model`s."""
    SSE_MODELS[model.__name__] = model
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string", "description": "Absent for data; `error` for a failure."},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"$ref": f"#/components/schemas/{model.__name__}"},
            },
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }
    return {200: {"description": description, "content": {"text/event-stream": {"itemSchema": event}}}}


def _add_models(schema: dict[str, Any]) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    models: list[type[BaseModel]] = [*SSE_MODELS.values(), ErrorResponse, TGIErrorResponse]
    for model in models:
        found = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in found.pop("$defs", {}).items():
            components.setdefault(name, sub)
        components.setdefault(model.__name__, found)


def _add_errors(schema: dict[str, Any], app: FastAPI) -> None:
    settings = app.state.settings
    for path, operations in schema.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            public = is_public(method.upper(), path, settings.metrics_require_auth)
            extra: dict[int, str] = {500: "Internal error (a clean error body, never a traceback)."}
            fam = family(method.upper(), path)
            if "requestBody" in op:
                extra.update(_BODY_ERRORS)
                extra[429] = "Overloaded: retry after `Retry-After` seconds."
                if fam == "openai":  # OpenAI answers every invalid request 400
                    del extra[422]
                    extra[400] = "Invalid request (the message names the field in `param`)."
            if path != METRICS_PATH:
                extra[503] = "Not ready, or shutting down."
            if settings.api_keys and not public:
                extra[401] = "Missing or invalid API key."
            elif public:
                op.pop("security", None)
            if fam == "openai":
                responses.pop("422", None)  # FastAPI's own validation entry
            content = _TGI_ERROR_REF if fam == "tgi" else _ERROR_REF
            for status, description in extra.items():
                responses.setdefault(str(status), {"description": description, "content": content})


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            _add_models(schema)
            _add_errors(schema, app)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


SWAGGER_UI_DIR = Path(__file__).resolve().parent.parent / "static" / "swagger-ui"
SWAGGER_UI_URL = "/static/swagger-ui/"
# Exactly the files the page loads: nothing else in the folder is reachable by name.
SWAGGER_UI_ASSETS = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8",
                     "swagger-ui.css": "text/css; charset=utf-8", "favicon-32x32.png": "image/png"}
DOCS_PATH, OAUTH2_REDIRECT_PATH = "/docs", "/docs/oauth2-redirect"


def install_docs_page(app: FastAPI) -> None:
    """GET /docs (Swagger UI) and its assets, all served by this server. Create the app with
    `docs_url=None` so that FastAPI's CDN page is not registered first."""

    @app.get(DOCS_PATH, include_in_schema=False)
    async def docs_page() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API",
            swagger_js_url=SWAGGER_UI_URL + "swagger-ui-bundle.js",
            swagger_css_url=SWAGGER_UI_URL + "swagger-ui.css",
            swagger_favicon_url=SWAGGER_UI_URL + "favicon-32x32.png",
            oauth2_redirect_url=OAUTH2_REDIRECT_PATH,
            # No badge from the online validator (validator.swagger.io): nothing leaves this origin.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get(OAUTH2_REDIRECT_PATH, include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(SWAGGER_UI_URL + "{name}", include_in_schema=False)
    async def swagger_ui_asset(name: str) -> FileResponse:
        media_type = SWAGGER_UI_ASSETS.get(name)
        if media_type is None:
            raise HTTPException(status_code=404, detail=f"no static file {name!r}")
        return FileResponse(SWAGGER_UI_DIR / name, media_type=media_type)
