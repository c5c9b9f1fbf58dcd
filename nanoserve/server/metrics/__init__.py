"""Prometheus metrics for nanoserve: one `Metrics` object per app, exposed at GET /metrics.

Wiring (nanoserve/server/app.py):

    metrics = Metrics()                       # its own registry: tests build many apps per process
    engine = Engine(checkpoint, config, observer=metrics.observer)
    metrics.bind_engine(engine)               # scheduler gauges + model info, read at scrape time
    metrics.install(app)                      # HTTP counters, in-flight, end-to-end duration
    async for event in metrics.track_stream(stream, route, request.state.arrival): ...
    body, content_type = metrics.render()     # the GET /metrics response

The metric list with one line each is in docs/operations.md.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from nanoserve.engine.types import EngineObserver, TokenEvent
from nanoserve.server.metrics.engine_collector import EngineCollector, EngineMetricsObserver, StatsSource
from nanoserve.server.metrics.http import HTTPMetricsMiddleware, arrival_time
from nanoserve.server.metrics.instruments import LATENCY_BUCKETS, Instruments
from nanoserve.server.metrics.models import ModelSample, ModelsCollector, reload_counter
from nanoserve.server.metrics.stream import StreamRecord, TrackableStream, track_stream

__all__ = ["LATENCY_BUCKETS", "Metrics", "arrival_time"]


class Metrics:
    """The registry, the instruments, and the hooks that feed them.

    Without `registry`, a new one with the process and Python collectors; a registry passed in is
    used as it is (nothing but nanoserve's own metrics is added to it).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # No `*_created` series: they double the series count and the 0.0.4 text format has no
        # place for them (they would show as separate gauges). The switch is process-wide.
        disable_created_metrics()
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
            # process_* (memory, CPU, fds) and python_* (version, GC), as every Python exporter has.
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        self.registry = registry
        self.instruments = Instruments(registry)
        self.observer: EngineObserver = EngineMetricsObserver(self.instruments)
        self._engine_collector: EngineCollector | None = None
        self._models: Callable[[], list[ModelSample]] = list
        registry.register(ModelsCollector(lambda: self._models()))
        self.reloads = reload_counter(registry)

    def bind_engine(self, engine: StatsSource) -> None:
        """Expose the engine's scheduler state and model info, read at each scrape."""
        if self._engine_collector is not None:
            self.registry.unregister(self._engine_collector)
        config = getattr(engine, "config", None)
        self._engine_collector = EngineCollector(engine, getattr(config, "max_queue", None))
        self.registry.register(self._engine_collector)

    def bind_models(self, models: Callable[[], list[ModelSample]]) -> None:
        """Expose each served model's gauges and version (`models` is read at each scrape)."""
        self._models = models

    def install(self, app: Any) -> None:
        """Add the HTTP middleware to a Starlette/FastAPI app (before it starts)."""
        app.add_middleware(HTTPMetricsMiddleware, instruments=self.instruments, routes=app.router.routes)

    def stream_record(self, stream: TrackableStream, route: str, arrival: float) -> StreamRecord:
        """A request's record, for `track_stream` and for events that go past it (`on_event`)."""
        return StreamRecord(self.instruments, route, arrival, stream.prompt_tokens)

    def track_stream(
        self, stream: TrackableStream, route: str, arrival: float, record: StreamRecord | None = None
    ) -> AsyncGenerator[TokenEvent, None]:
        """Wrap a `GenerationStream`: same events, recorded (TTFT from `arrival`, ITL, tokens, finish)
        into `record` (`stream_record`; a new one by default)."""
        return track_stream(self.instruments, stream, route, arrival, record)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for the GET /metrics response."""
        # The 0.0.4 text format: what every Prometheus 2.x parses (no UTF-8 metric names are used).
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4

