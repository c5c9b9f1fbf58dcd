"""`nanoserve serve`: validate everything, load the checkpoint, then open the port.

Flags override `NANOSERVE_*` environment variables, which override defaults (nanoserve/server/settings.py).
A bad setting, a missing or corrupt checkpoint, or an impossible device/dtype is one clear line on
stderr and a non-zero exit before the port opens.

SIGHUP reloads the checkpoints whose files changed, without dropping a request
(nanoserve/server/models/reload.py). SIGTERM (or Ctrl-C) drains: readiness turns 503 and new
requests get 503 at once, requests already accepted finish within `drain_timeout`, then the
process exits 0. A second Ctrl-C forces the exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any, get_args, get_origin

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError

from nanoserve.server.models.registry import ModelSpec, model_specs
from nanoserve.server.settings import Settings, unknown_variables

if TYPE_CHECKING:
    from nanoserve.server.http.connection_guard import ConnectionLimits

log = logging.getLogger("nanoserve.serve")

# Seconds uvicorn waits, after the drain, for responses to flush and idle connections to close.
FLUSH_TIMEOUT_S = 5


def _is_bool(annotation: Any) -> bool:
    return annotation is bool or (get_origin(annotation) is not None and bool in get_args(annotation))


def add_serve_parser(sub: Any) -> None:
    """Register `serve` on the `nanoserve` command's subparsers: one flag per setting."""
    parser = sub.add_parser(
        "serve",
        help="serve a checkpoint over HTTP",
        description="Serve a checkpoint over HTTP. Every flag can also be set as NANOSERVE_<NAME> "
        "(e.g. NANOSERVE_PORT=8080); flags win.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        helptext = (field.description or name.replace("_", " ")) + f" [env NANOSERVE_{name.upper()}]"
        if name == "api_keys":
            helptext += " (prefer the environment: flags show up in `ps`)"
        if name == "checkpoint":  # repeatable: several models in one server
            parser.add_argument(flag, dest=name, action="append", default=argparse.SUPPRESS,
                                metavar="[NAME=]PATH", help=helptext + "; repeat it to serve several "
                                "(each named NAME, else by its checkpoint's name; the first is the default)")
        elif _is_bool(field.annotation):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=helptext)
        else:
            parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, metavar=name.upper(),
                                help=helptext)
    parser.set_defaults(func=run_serve)


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    paths = overrides.pop("checkpoint", None)
    if paths:  # one plain PATH is `checkpoint`; several, or NAME=PATH, are `models`
        specs = [ModelSpec.parse(p) for p in paths]
        overrides["checkpoint"] = specs[0].path
        if len(paths) > 1 or specs[0].name is not None:
            overrides["models"] = paths
    return Settings(**overrides)


def _fail(message: str) -> int:
    print(f"nanoserve serve: error: {message}", file=sys.stderr)
    return 2


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = err.get("loc", ())
        where = ".".join(str(p) for p in loc) or "settings"
        # The offending value helps, except for keys: those never reach a terminal or a log.
        shown = "" if not loc or loc[0] == "api_keys" else f" (got {err.get('input')!r})"
        parts.append(f"{where}: {err.get('msg')}{shown}")
    return "; ".join(parts)


def run_serve(args: argparse.Namespace) -> int:
    from nanoserve.engine.memory_plan import check_memory
    from nanoserve.engine.threads import single_threaded_elsewhere
    from nanoserve.model.chat_template import ChatTemplateError
    from nanoserve.model.checkpoint import CheckpointError, load_checkpoint, with_chat_template_file
    from nanoserve.server.app import create_app, engine_config
    from nanoserve.server.http.access_log import configure_logging
    from nanoserve.server.http.connection_guard import ConnectionGuard
    from nanoserve.server.http.protocol import NanoserveHttpProtocol

    # Before the first torch op: only the engine thread may start an OpenMP pool.
    single_threaded_elsewhere()

    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        return _fail(_describe(e))
    checkpoints, names = [], []
    try:
        engine = engine_config(settings)  # device/dtype, fault spec: fail before loading anything
        for spec in model_specs(settings.checkpoint, settings.models):
            checkpoint = load_checkpoint(spec.path)
            # The KV cache and the engine's other buffers against memory, before any is allocated.
            # Engines load one after another, each checked against what the ones before left.
            check_memory(checkpoint, engine)
            if settings.chat_template is not None:
                checkpoint = with_chat_template_file(checkpoint, settings.chat_template)
            checkpoints.append(checkpoint)
            name = spec.name or checkpoint.name
            if name in names:
                raise ValueError(f"two models are named {name!r}: name one with --checkpoint NAME=PATH")
            names.append(name)
        del checkpoint
    except CheckpointError as e:
        return _fail(f"cannot load checkpoint: {e}")
    except ChatTemplateError as e:
        return _fail(f"--chat-template {e}")
    except ValueError as e:
        return _fail(str(e))
    configure_logging(settings.log_level, settings.log_format)
    for warning in unknown_variables(os.environ):
        log.warning(warning)
    app = create_app(settings, checkpoints=checkpoints)
    del checkpoints  # the app's lifespan hands them to the engines and drops them (nanoserve/server/app.py)
    guard = ConnectionGuard(connection_limits(settings), app.state.metrics.instruments)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # our logging (configure_logging) already handles uvicorn's loggers
        access_log=False,  # one access line per request comes from nanoserve/server/http/access_log.py
        lifespan="on",
        timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
        proxy_headers=False,
        # Streams write mid-stream events without ASGI; connection limits (http_protocol.py).
        http=NanoserveHttpProtocol.with_guard(guard),
        ws="none",  # no route speaks WebSocket: an upgrade request is an ordinary HTTP request
    )
    server = DrainingServer(config, app, settings.drain_timeout)
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits 3 when the app's start-up fails (already logged)
        return int(e.code or 1) if not isinstance(e.code, str) else 1
    if not server.started:
        return 1
    return 0


def connection_limits(settings: Settings) -> ConnectionLimits:
    """The protocol's limits: the settings, with max_connections lowered to fit the open-file limit
    (raised to its hard limit first), so that accept() never fails for want of a descriptor."""
    from nanoserve.server.http.connection_guard import (
        REQUEST_LINE_BYTES,
        ConnectionLimits,
        connection_capacity,
        raise_open_file_limit,
    )

    files = raise_open_file_limit()
    capacity = connection_capacity(settings.max_connections, files)
    if capacity < settings.max_connections:
        log.warning("max_connections lowered from %d to %d to fit the open-file limit of %d",
                    settings.max_connections, capacity, files)
    else:
        log.info("connections: at most %d open (open-file limit %d)", capacity, files)
    return ConnectionLimits(
        max_connections=capacity,
        max_connections_per_client=settings.max_connections_per_client,
        header_timeout=settings.header_timeout,
        idle_timeout=settings.idle_timeout,
        max_head_bytes=settings.max_header_bytes + REQUEST_LINE_BYTES,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain on SIGTERM/SIGINT: stop admitting, finish in-flight work, exit 0."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self.app = app
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future[None] | None = None
        self._signalled = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        # SIGHUP reloads the checkpoints whose files changed (nanoserve/server/models/reload.py)
        # instead of ending the process.
        self._loop.add_signal_handler(signal.SIGHUP, self._reload)
        try:
            await super().serve(sockets)
        finally:
            self._loop.remove_signal_handler(signal.SIGHUP)

    def _reload(self) -> None:
        reloader = self.app.state.reloader
        if reloader is None or self.app.state.lifecycle.is_draining():
            log.info("received SIGHUP: nothing to reload (%s)",
                     "draining" if reloader is not None else "still loading")
            return
        log.info("received SIGHUP: reloading the checkpoints whose files changed")
        reloader.spawn(reloader.reload())

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handler: that one re-raises the signal after shutdown (exit status -15).
        if self._signalled or self._loop is None or not self.started:
            if sig == signal.SIGINT and self._signalled:
                self.force_exit = True
            self.should_exit = True
            return
        self._signalled = True
        # Stop admitting now, not when the drain task first runs: a request read between the signal
        # and that task (a few loop turns later) would otherwise still be admitted. Python runs
        # signal handlers on the main thread, the event loop's, so this is no race with the routes.
        self.app.state.lifecycle.draining = True
        log.info("received %s: draining (timeout %.1fs)", signal.Signals(sig).name, self.drain_timeout)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        from nanoserve.server.app import drain

        try:
            drained = asyncio.ensure_future(drain(self.app, self.drain_timeout))
            lifecycle = self.app.state.lifecycle
            while not lifecycle.is_draining() and not drained.done():
                await asyncio.sleep(0)  # drain() marks the app draining before its first wait
            # Requests still waiting for the rest of their body are not admitted yet: they get the
            # drain's 503 now (request_guard.DrainGate), not a cancellation when the server stops.
            for connection in list(self.server_state.connections):
                wake = getattr(connection, "wake_body_reader", None)
                if wake is not None:
                    wake()
            await drained
        except Exception:
            log.exception("drain failed")
        finally:
            self.should_exit = True
