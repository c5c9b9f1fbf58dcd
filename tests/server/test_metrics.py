"""Unit tests of nanoserve/server/metrics: stream tracking, observer hooks, engine gauges, HTTP middleware.

Fakes stand in for the engine here (scripted token streams, a stats object); the real engine and a
real server are exercised in test_metrics_server.py and tests/deploy/test_prometheus_live.py.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.responses import Response, StreamingResponse

from nanoserve.engine.types import EngineStats, FinishReason, TokenEvent, Usage
from nanoserve.server.metrics import Metrics
from nanoserve.server.metrics.http import RouteTemplates, match_route
from tests.conftest import require_tool


def usage(generated: int, prompt: int = 3, cropped: int = 0) -> Usage:
    return Usage(prompt, generated, cropped, seed=1, queue_time_s=0.002, prefill_time_s=0.003,
                 ttft_s=0.004, total_time_s=0.01)


def events(n: int, reason: FinishReason = FinishReason.LENGTH) -> list[TokenEvent]:
    """`n` token events, the last one carrying `reason` and usage (n=0: a bare last event)."""
    out = [TokenEvent(i, 40 + i, "x") for i in range(n)]
    last = TokenEvent(n - 1 if n else 0, out[-1].token_id if n else None, "", finish_reason=reason,
                      usage=usage(n))
    return [*out[:-1], last] if n else [last]


@dataclass
class ScriptedStream:
    """A GenerationStream stand-in: yields scripted events, optionally raises, records aclose()."""

    script: list[TokenEvent]
    prompt_tokens: int = 3
    cropped_tokens: int = 0
    raise_after: int | None = None
    closed: bool = False
    delay_s: float = 0.0
    _sent: int = field(default=0, init=False)

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.raise_after is not None and self._sent >= self.raise_after:
            raise RuntimeError("engine exploded")
        if self.closed or self._sent >= len(self.script):
            raise StopAsyncIteration
        await asyncio.sleep(self.delay_s)
        self._sent += 1
        return self.script[self._sent - 1]

    async def aclose(self) -> None:
        self.closed = True


def value(metrics: Metrics, name: str, **labels: str) -> float:
    got = metrics.registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def finished_by_reason(metrics: Metrics, route: str) -> dict[str, float]:
    return {r.value: value(metrics, "nanoserve_requests_finished_total", route=route, finish_reason=r.value)
            for r in FinishReason}


async def drain(metrics: Metrics, stream: ScriptedStream, route: str = "/generate") -> list[TokenEvent]:
    return [e async for e in metrics.track_stream(stream, route, arrival=0.0)]


async def test_tracked_stream_yields_same_events_and_counts_tokens() -> None:
    m = Metrics()
    script = events(4)
    got = await drain(m, ScriptedStream(script, prompt_tokens=7, cropped_tokens=2))
    assert got == script
    assert value(m, "nanoserve_generated_tokens_total") == 4
    assert value(m, "nanoserve_prompt_tokens_total") == 7
    assert value(m, "nanoserve_cropped_prompt_tokens_total") == 2
    assert value(m, "nanoserve_time_to_first_token_seconds_count") == 1
    assert value(m, "nanoserve_inter_token_latency_seconds_count") == 3
    assert value(m, "nanoserve_queue_duration_seconds_count") == 1
    assert value(m, "nanoserve_request_generated_tokens_sum") == 4
    assert value(m, "nanoserve_request_generated_tokens_bucket", le="4.0") == 1
    assert value(m, "nanoserve_request_generated_tokens_bucket", le="2.0") == 0
    assert value(m, "nanoserve_request_prompt_tokens_sum") == 7
    # Arrival was perf_counter() 0.0, long before: TTFT and queue time include the time before it.
    assert value(m, "nanoserve_time_to_first_token_seconds_sum") > 0
    assert value(m, "nanoserve_queue_duration_seconds_sum") >= 0.002


async def test_every_finished_request_lands_in_exactly_one_reason_series() -> None:
    m = Metrics()
    reasons = [FinishReason.LENGTH, FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE,
               FinishReason.ERROR, FinishReason.LENGTH]
    for reason in reasons:
        await drain(m, ScriptedStream(events(2, reason)))
    await drain(m, ScriptedStream(events(0, FinishReason.ERROR)))  # error before any token
    counts = finished_by_reason(m, "/generate")
    assert sum(counts.values()) == len(reasons) + 1
    assert counts == {"length": 2, "eos_token": 1, "stop_sequence": 1, "error": 2, "cancelled": 0}
    assert value(m, "nanoserve_requests_cancelled_total", route="/generate") == 0


async def test_client_leaving_early_counts_cancelled_once_and_closes_engine_stream() -> None:
    m = Metrics()
    stream = ScriptedStream(events(10))
    tracked = m.track_stream(stream, "/v1/completions", arrival=0.0)
    assert (await anext(tracked)).index == 0
    await tracked.aclose()  # what a disconnect does to the response's body iterator
    assert stream.closed, "the engine stream must be closed so its KV slot is freed"
    counts = finished_by_reason(m, "/v1/completions")
    assert counts["cancelled"] == 1 and sum(counts.values()) == 1
    assert value(m, "nanoserve_requests_cancelled_total", route="/v1/completions") == 1
    assert value(m, "nanoserve_generated_tokens_total") == 1


async def test_task_cancelled_while_waiting_for_a_token_counts_cancelled() -> None:
    m = Metrics()
    stream = ScriptedStream(events(10), delay_s=5.0)

    async def consume() -> None:
        await drain(m, stream, "/generate_stream")

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stream.closed
    assert finished_by_reason(m, "/generate_stream")["cancelled"] == 1
    assert value(m, "nanoserve_requests_cancelled_total", route="/generate_stream") == 1


async def test_closing_after_the_last_event_is_not_a_cancellation() -> None:
    m = Metrics()
    tracked = m.track_stream(ScriptedStream(events(2, FinishReason.EOS_TOKEN)), "/generate", 0.0)
    async for event in tracked:
        if event.finish_reason is not None:
            break  # a route that stops reading at the last event
    await tracked.aclose()
    counts = finished_by_reason(m, "/generate")
    assert counts["eos_token"] == 1 and sum(counts.values()) == 1
    assert value(m, "nanoserve_requests_cancelled_total", route="/generate") == 0


async def test_stream_that_raises_counts_one_error_and_propagates() -> None:
    m = Metrics()
    with pytest.raises(RuntimeError, match="engine exploded"):
        await drain(m, ScriptedStream(events(5), raise_after=2))
    counts = finished_by_reason(m, "/generate")
    assert counts["error"] == 1 and sum(counts.values()) == 1
    assert value(m, "nanoserve_requests_cancelled_total", route="/generate") == 0


def test_observer_records_steps_prefill_and_rejections() -> None:
    m = Metrics()
    m.observer.on_step(0.004, 3, 17)
    m.observer.on_step(0.002, 1, 0)
    m.observer.on_finish(FinishReason.LENGTH, usage(5))
    m.observer.on_rejected("overloaded")
    m.observer.on_rejected("overloaded")
    assert value(m, "nanoserve_engine_step_duration_seconds_count") == 2
    assert value(m, "nanoserve_engine_batch_size_sum") == 4
    assert value(m, "nanoserve_engine_prefill_tokens_total") == 17
    assert value(m, "nanoserve_prefill_duration_seconds_count") == 1
    assert value(m, "nanoserve_requests_rejected_total", reason="overloaded") == 2


@dataclass
class FakeEngine:
    stats_value: EngineStats
    ready: bool = True
    broken: bool = False

    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(max_queue=64))

    def health(self) -> bool:
        if self.broken:
            raise RuntimeError("engine gone")
        return True

    def stats(self) -> EngineStats:
        if self.broken:
            raise RuntimeError("engine gone")
        return self.stats_value

    def info(self) -> dict[str, object]:
        # The shape of Engine.info() (the /info payload), trimmed.
        return {"model": "tiny-test", "parameters": 12345, "window": 64, "device": "cpu", "dtype": "float32",
                "model_config": {"block_size": 64}, "max_queue": 64}


def test_engine_gauges_are_read_at_scrape_time_and_idle_reads_zero() -> None:
    m = Metrics()
    engine = FakeEngine(EngineStats(running=2, waiting=5, slots_used=2, slots_total=8, kv_cache_bytes=4096,
                                    extra={"context_shifts_total": 3.0}))
    m.bind_engine(engine)
    assert value(m, "nanoserve_engine_context_shifts_total") == 3
    assert value(m, "nanoserve_running_sequences") == 2
    assert value(m, "nanoserve_waiting_requests") == 5
    assert value(m, "nanoserve_kv_slots_in_use") == 2
    assert value(m, "nanoserve_kv_slots_capacity") == 8
    assert value(m, "nanoserve_kv_cache_bytes") == 4096
    assert value(m, "nanoserve_queue_capacity") == 64
    assert value(m, "nanoserve_ready") == 1
    assert value(m, "nanoserve_model_info", checkpoint="tiny-test", parameters="12345", device="cpu",
                 dtype="float32", window="64") == 1
    engine.stats_value = EngineStats(running=0, waiting=0, slots_used=0, slots_total=8, kv_cache_bytes=4096)
    engine.ready = False
    assert value(m, "nanoserve_running_sequences") == 0
    assert value(m, "nanoserve_waiting_requests") == 0
    assert value(m, "nanoserve_kv_slots_in_use") == 0
    assert value(m, "nanoserve_ready") == 0


def test_broken_engine_does_not_break_the_scrape() -> None:
    m = Metrics()
    m.bind_engine(FakeEngine(EngineStats(0, 0, 0, 1, 0), broken=True))
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    assert b"nanoserve_running_sequences" not in body  # missing, not a stale or made-up value
    assert b"process_cpu_seconds_total" in body
    # Health must read 0 rather than vanish, or the alert on it could never fire.
    assert m.registry.get_sample_value("nanoserve_engine_healthy") == 0


def app_with_metrics(m: Metrics) -> FastAPI:
    app = FastAPI()
    router = APIRouter()  # included routers are how the real app is built

    @router.get("/items/{item_id}")
    async def item(item_id: int) -> dict[str, int]:
        return {"item_id": item_id}

    app.include_router(router)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("unhandled")

    @app.post("/stream")
    async def stream() -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            async for event in m.track_stream(ScriptedStream(events(3)), "/stream", 0.0):
                yield event.text

        return StreamingResponse(body())

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = m.render()
        return Response(body, media_type=content_type)

    m.install(app)
    return app


async def test_http_requests_counted_by_route_template_and_status_and_in_flight_returns_to_zero() -> None:
    m = Metrics()
    app = app_with_metrics(m)
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.get("/items/1")).status_code == 200
        assert (await client.get("/items/2")).status_code == 200
        assert (await client.get("/items/not-a-number")).status_code == 422
        assert (await client.post("/items/1")).status_code == 405
        assert (await client.get("/no/such/path")).status_code == 404
        assert (await client.get("/boom")).status_code == 500
        assert (await client.post("/stream")).text == "xx"
    count = "nanoserve_http_requests_total"
    assert value(m, count, route="/items/{item_id}", method="GET", code="200") == 2
    assert value(m, count, route="/items/{item_id}", method="GET", code="422") == 1
    assert value(m, count, route="/items/{item_id}", method="POST", code="405") == 1
    assert value(m, count, route="unmatched", method="GET", code="404") == 1
    assert value(m, count, route="/boom", method="GET", code="500") == 1
    assert value(m, count, route="/stream", method="POST", code="200") == 1
    assert value(m, "nanoserve_http_request_duration_seconds_count", route="/items/{item_id}") == 4
    for route in ("/items/{item_id}", "unmatched", "/boom", "/stream"):
        # The series exists (the request was in flight under that label) and is back to zero.
        assert m.registry.get_sample_value("nanoserve_http_requests_in_flight", {"route": route}) == 0
    assert finished_by_reason(m, "/stream")["length"] == 1


def test_route_templates_remember_only_the_apps_own_static_paths() -> None:
    app = app_with_metrics(Metrics())
    templates = RouteTemplates(app.routes)

    def scope(method: str, path: str) -> dict[str, object]:
        return {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}

    asked = [("GET", "/boom"), ("GET", "/items/7"), ("GET", "/items/8"), ("POST", "/items/7"),
             ("GET", "/no/such/path"), ("POST", "/stream"), ("GET", "/stream")]
    for _ in range(2):  # the second round is answered from memory where it may be
        for method, path in asked:
            assert templates(scope(method, path)) == match_route(app.routes, scope(method, path))
    assert templates(scope("GET", "/items/7")) == "/items/{item_id}"
    assert templates(scope("GET", "/stream")) == "/stream"  # the wrong method: still its template (a 405)
    assert templates(scope("GET", "/no/such/path")) is None
    # Kept: /boom and /stream (both methods); not the item paths nor the made-up one.
    assert len(templates) == 3


@pytest.mark.system_tool
async def test_metrics_output_passes_promtool_check_metrics() -> None:
    promtool = require_tool("promtool", "Debian package prometheus")
    m = Metrics()
    m.bind_engine(FakeEngine(EngineStats(1, 0, 1, 4, 2048)))
    m.observer.on_step(0.003, 1, 5)
    m.observer.on_rejected("overloaded")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app_with_metrics(m)),
                                 base_url="http://test") as client:
        await client.post("/stream")
        await client.get("/items/3")
        response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    check = subprocess.run([promtool, "check", "metrics"], input=response.content, capture_output=True,
                           timeout=30)
    assert check.returncode == 0, (check.stdout + check.stderr).decode()
