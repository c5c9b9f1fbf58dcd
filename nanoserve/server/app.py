"""The FastAPI application: `create_app(settings)` builds it; the lifespan loads the models (one
engine each, in `app.state.registry`: nanoserve/server/models/).

Layout of a request (outermost first): RequestContextMiddleware (arrival time, X-Request-Id,
access log) -> the metrics middleware -> ErrorDialects (each API family's error shape) -> CORS
(only when origins are configured) -> HeaderLimitMiddleware (431) -> DrainGate (503 while
shutting down) -> ApiKeyGate (401, when keys are set) -> BodyLimitMiddleware (413) -> HeadAsGet
(HEAD on GET routes) -> ModelHeaders (X-Nanoserve-Model) -> FastAPI (routes, the shared error
handlers of nanoserve/server/http/errors.py).
The OpenAPI document is completed by nanoserve/server/api/docs.py (shared error statuses, SSE events).

Integration points for other modules:

1. Routers. The OpenAI-compatible API and the chat page add themselves in `_include_routers`:
   `app.include_router(openai_router)` / `app.include_router(chat_router)`. The API-key
   gate covers every path but the public ones (nanoserve/server/http/auth.py), so nothing extra is needed.
   Routes get the engine of the request's model with `engine: EngineDep` (the body's `model` on
   /v1, the X-Model header elsewhere) and settings with `settings: SettingsDep`
   (nanoserve/server/deps.py, re-exported here), and run generations through
   nanoserve/server/streaming/generation.py (`start_generation`, `collect`) and
   nanoserve/server/streaming/sse.py (`event_stream`),
   so limits, metrics, the access log, keep-alives, disconnects and error events behave the same
   on every route. Document a streamed 200 with `api_docs.sse_response_doc(description, Model)`.
2. Metrics. `nanoserve.server.metrics.Metrics` (one per app, `app.state.metrics`): its `observer` is passed
   to the Engine, `bind_engine(engine)` after the engine is built, `install(app)` adds the HTTP
   middleware, `track_stream(stream, route, arrival)` wraps every generation (done by
   `start_generation`), `render()` serves GET /metrics (routes/system.py).
3. `request.state.arrival` (time.perf_counter() at the very start of the request) and
   `request.state.request_id` are set for every request by RequestContextMiddleware.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from nanoserve.engine.backends.factory import check_backend
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.config import rules as engine_rules
from nanoserve.engine.engine import Engine
from nanoserve.engine.threads import single_threaded_executor
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.server.api.docs import install_docs_page, install_openapi
from nanoserve.server.api.openai.responses_store import ResponseStore
from nanoserve.server.deps import EngineDep, SettingsDep, get_engine, get_settings, server_version
from nanoserve.server.http.access_log import RequestContextMiddleware
from nanoserve.server.http.auth import ApiKeyGate, require_api_key
from nanoserve.server.http.error_dialects import ErrorDialects
from nanoserve.server.http.errors import install_error_handlers
from nanoserve.server.http.head import HeadAsGet
from nanoserve.server.http.request_guard import BodyLimitMiddleware, DrainGate, HeaderLimitMiddleware
from nanoserve.server.metrics import Metrics
from nanoserve.server.metrics.models import ModelSample
from nanoserve.server.models.headers import ModelHeaders
from nanoserve.server.models.loading import START_ATTEMPTS, CheckpointChanged, load_served
from nanoserve.server.models.registry import ModelRegistry, ServedModel, model_specs
from nanoserve.server.models.reload import Reloader
from nanoserve.server.runtime.gil import apply_switch_interval
from nanoserve.server.runtime.heap import freeze_startup_heap
from nanoserve.server.settings import Settings
from nanoserve.server.streaming.encoding import EncodeQueue

log = logging.getLogger("nanoserve.app")

__all__ = ["EngineDep", "SettingsDep", "create_app", "drain", "get_engine", "get_settings"]


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's settings, taken from the server's (raises ValueError naming a bad combination,
    a backend that cannot run here included)."""
    config = EngineConfig(**{name: getattr(settings, name) for name in engine_rules()})
    check_backend(config)
    return config


class Lifecycle:
    """Readiness and draining, shared by the routes, the drain gate and `nanoserve serve`."""

    def __init__(self) -> None:
        self.draining = False  # no longer admitting: readiness and new requests answer 503
        self.drain_started = False

    def is_draining(self) -> bool:
        return self.draining


async def drain(app: FastAPI, timeout_s: float) -> None:
    """Stop admitting (readiness 503, new requests 503), let in-flight requests finish, stop the engines."""
    lifecycle: Lifecycle = app.state.lifecycle
    if lifecycle.drain_started:
        return
    lifecycle.drain_started = True
    lifecycle.draining = True
    registry: ModelRegistry = app.state.registry
    log.info("draining: waiting up to %.1fs for in-flight requests", timeout_s)
    cut = sum(await asyncio.gather(*(e.shutdown(timeout_s) for e in registry.engines())))
    if cut:
        log.warning("drain timeout (%.1fs) cut %d unfinished request%s", timeout_s, cut,
                    "s" if cut != 1 else "")
    else:
        log.info("drained")  # every in-flight request finished


async def _load_models(app: FastAPI, config: EngineConfig) -> None:
    """Load, validate and warm up every model the settings name, in order (the first is the default)."""
    settings: Settings = app.state.settings
    registry: ModelRegistry = app.state.registry
    # Checkpoints handed to create_app serve one start: nothing may keep their weights once the
    # engines have them (the runner frees the model's copies the native step packed); a later
    # start loads the files they came from.
    given: list[Checkpoint] = app.state.checkpoints
    app.state.checkpoints = []
    for i, spec in enumerate(model_specs(settings.checkpoint, settings.models)):
        checkpoint = given[i] if i < len(given) else None
        # `nanoserve serve` applied --chat-template to the checkpoints it loaded already.
        template = settings.chat_template if checkpoint is None else None
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                served = await load_served(spec, config, app.state.metrics.observer, chat_template=template,
                                           checkpoint=checkpoint, accept_change=attempt == START_ATTEMPTS)
                break
            except CheckpointChanged as e:
                log.warning("%s; reading it again", e)
                checkpoint, template = None, settings.chat_template  # the given one is out of date
        del checkpoint
        try:
            registry.add(served)
        except ValueError:
            await served.engine.shutdown(0.0)
            raise
        log.info("model %s: %s, window %d, from %s", served.name, served.version.label(),
                 served.engine.window, served.path)
    given.clear()


def _serve_default(app: FastAPI, served: ServedModel) -> None:
    """After a load or a swap: app.state.engine and the unlabelled gauges follow the default model."""
    registry: ModelRegistry = app.state.registry
    if registry.default is served:
        app.state.engine = served.engine
        app.state.metrics.bind_engine(served.engine)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    # Before the first `to_thread`: blocking work (loading, the engine's weight packing, long
    # prompts' encoding) must not leave an OpenMP pool beside the engine thread's.
    asyncio.get_running_loop().set_default_executor(single_threaded_executor())
    metrics: Metrics = app.state.metrics
    registry: ModelRegistry = app.state.registry
    config = engine_config(settings)
    # The server's own process: an application embedding the Engine keeps its interpreter's setting.
    apply_switch_interval(settings.gil_switch_interval, config.resolved_device())
    frozen = False
    reloader: Reloader | None = None
    try:
        await _load_models(app, config)
        default = registry.default
        assert default is not None
        _serve_default(app, default)
        reloader = Reloader(
            registry, config, metrics.observer, chat_template=settings.chat_template,
            drain_timeout=settings.drain_timeout, counter=metrics.reloads,
            on_swap=lambda served: _serve_default(app, served),
        )
        app.state.reloader = reloader
        if settings.watch:
            reloader.spawn(reloader.watch())
        frozen = freeze_startup_heap()
        weights = config.dtype
        if config.quantize == "int8":
            weights = f"int8 (linear layers; the rest {config.dtype})"
        log.info("serving %s (window %d) on %s, weights %s", ", ".join(registry.names()),
                 default.engine.window, config.resolved_device(), weights)
        yield
    finally:
        app.state.engine = None
        app.state.reloader = None
        if reloader is not None:
            reloader.stop()
        if frozen:
            gc.unfreeze()
        timeout = 0.0 if app.state.lifecycle.draining else settings.drain_timeout
        await asyncio.gather(*(drain_engine(e, timeout) for e in registry.engines()))


async def drain_engine(engine: Engine, timeout_s: float) -> None:
    try:
        await engine.shutdown(timeout_s)
    except Exception:
        log.exception("engine shutdown failed")


def _include_routers(app: FastAPI) -> None:
    from nanoserve.server.api.chat_page import router as chat_page_router
    from nanoserve.server.api.openai.embeddings import router as embeddings_router
    from nanoserve.server.api.openai.responses import router as responses_router
    from nanoserve.server.api.openai.routes import router as openai_router
    from nanoserve.server.api.system import router as system_router
    from nanoserve.server.api.tgi.routes import router as tgi_router
    from nanoserve.server.models.routes import router as models_router

    app.include_router(system_router)
    app.include_router(tgi_router)
    app.include_router(openai_router)
    app.include_router(embeddings_router)
    app.include_router(responses_router)
    app.include_router(chat_page_router)
    app.include_router(models_router)


def create_app(
    settings: Settings | None = None, *, checkpoint: Checkpoint | None = None,
    checkpoints: list[Checkpoint] | None = None,
) -> FastAPI:
    """The ASGI app. `checkpoint` (or `checkpoints`, one per model the settings name, in order), when
    given, is served instead of loading the files (at the first start only: see _load_models)."""
    settings = settings or Settings()
    app = FastAPI(
        title="nanoserve",
        version=server_version(),
        description="Text generation for small GPT models: the TGI API and an "
        "OpenAI-compatible API, with SSE streaming.",
        lifespan=lifespan,
        # Only with keys: without them the OpenAPI document must not claim a security scheme.
        dependencies=[Depends(require_api_key)] if settings.api_keys else [],
        # No 307 to the path without its trailing slash: its Location would be built from the
        # client's Host header (an open redirect). A trailing slash is a 404 like any unknown path.
        redirect_slashes=False,
        docs_url=None,  # install_docs_page: the same page, its assets served from here, not a CDN
    )
    app.state.settings = settings
    app.state.checkpoints = list(checkpoints or ([checkpoint] if checkpoint is not None else []))
    app.state.registry = registry = ModelRegistry()
    app.state.reloader = None
    app.state.engine = None  # the default model's engine (nanoserve/server/models/registry.py)
    app.state.api_keys = settings.api_key_values()
    app.state.lifecycle = Lifecycle()
    app.state.metrics = Metrics()
    app.state.metrics.bind_models(
        lambda: [ModelSample(m.name, m.version.label(), m.engine) for m in registry])
    app.state.encode_queue = EncodeQueue(settings.max_pending_encode_chars)
    app.state.responses_store = ResponseStore(settings.responses_store, settings.responses_store_mb << 20)
    install_error_handlers(app)
    _include_routers(app)
    install_openapi(app)
    install_docs_page(app)
    # add_middleware wraps: the last one added is the outermost.
    app.add_middleware(ModelHeaders)
    app.add_middleware(HeadAsGet)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes,
                       timeout_s=settings.body_timeout)
    if settings.api_keys:  # before the body is read or its size judged (nanoserve/server/http/auth.py)
        app.add_middleware(ApiKeyGate, keys=app.state.api_keys,
                           metrics_require_auth=settings.metrics_require_auth)
    app.add_middleware(DrainGate, is_draining=app.state.lifecycle.is_draining)
    app.add_middleware(HeaderLimitMiddleware, max_bytes=settings.max_header_bytes,
                       max_count=settings.max_headers)
    if settings.cors_origins:
        from nanoserve.server.api.openai.routes import DROPPED_HEADER

        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
            expose_headers=["X-Request-Id", "Retry-After", DROPPED_HEADER],
        )
    app.add_middleware(ErrorDialects)  # outside CORS: its plain-text refusals get the error shape
    app.state.metrics.install(app)  # outside ErrorDialects: it counts the statuses clients get
    app.add_middleware(RequestContextMiddleware)
    return app
