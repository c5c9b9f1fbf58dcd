"""Metrics of the real app with the real engine: finish reasons, token counts, cancellation by a
client that disconnects, rejection when overloaded, and gauges back to zero when idle.

The app runs in a uvicorn server on a thread of this process (real sockets, so disconnects are real,
and the registry can be read directly); a single KV slot and a queue of one make overload easy.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from nanoserve.engine.types import FinishReason
from nanoserve.server.app import create_app
from nanoserve.server.http.protocol import NanoserveHttpProtocol
from nanoserve.server.metrics import Metrics
from nanoserve.server.settings import Settings
from tests.faults import injected_faults

FAULT = "FAULTY"  # prompts containing this get NaN logits (tests/faults.py)


@contextmanager
def serve_in_thread(checkpoint: Path, http: type[asyncio.Protocol] | str = NanoserveHttpProtocol
                    ) -> Iterator[tuple[str, Metrics]]:
    """The app on a uvicorn thread, by default with the protocol `nanoserve serve` runs."""
    settings = Settings(checkpoint=checkpoint, device="cpu", max_seqs=1, max_queue=1, keepalive_interval=0.2,
                        drain_timeout=1.0, max_new_tokens=1_000_000)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", http=http))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    try:
        with injected_faults(f"nan:{FAULT}"):  # the engine is built during start-up
            thread.start()
            wait_until("the server to start", lambda: server.started or not thread.is_alive(), 60)
        assert server.started, "uvicorn exited during start-up"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", app.state.metrics
    finally:
        server.should_exit = True
        thread.join(30)


def wait_until(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Path) -> Iterator[tuple[str, Metrics]]:
    with serve_in_thread(tiny_checkpoint) as s:
        yield s


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    got = metrics.registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def finished(metrics: Metrics) -> dict[tuple[str, str], float]:
    """Every finish-reason series: (route, reason) -> count."""
    family = next(f for f in metrics.registry.collect() if f.name == "nanoserve_requests_finished")
    return {(s.labels["route"], s.labels["finish_reason"]): s.value
            for s in family.samples if s.name.endswith("_total")}


def idle(metrics: Metrics) -> bool:
    return (sample(metrics, "nanoserve_running_sequences") == 0
            and sample(metrics, "nanoserve_waiting_requests") == 0
            and sample(metrics, "nanoserve_kv_slots_in_use") == 0
            and sample(metrics, "nanoserve_http_requests_in_flight", route="/generate_stream") == 0
            and sample(metrics, "nanoserve_http_requests_in_flight", route="/generate") == 0)


def body(inputs: str = "Hello", **params: object) -> dict[str, object]:
    return {"inputs": inputs, "parameters": params}


async def test_each_finished_request_is_in_one_reason_series_with_its_tokens(
    served: tuple[str, Metrics],
) -> None:
    url, metrics = served
    before = finished(metrics)
    tokens_before = sample(metrics, "nanoserve_generated_tokens_total")
    prompt_before = sample(metrics, "nanoserve_prompt_tokens_total")
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        greedy = {"max_new_tokens": 6, "temperature": 0, "details": True}
        first = (await client.post("/generate", json=body("Hello", **greedy))).json()
        stop = first["generated_text"][1]  # greedy is deterministic: this text will appear again
        stopped = (await client.post("/generate", json=body("Hello", **greedy, stop=[stop]))).json()
        failed = await client.post("/generate", json=body(f"{FAULT} x", max_new_tokens=4))
    assert first["details"]["finish_reason"] == "length"
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert failed.status_code == 424  # TGI's status for a failed generation
    after = finished(metrics)
    delta = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
    assert delta == {("/generate", FinishReason.LENGTH.value): 1, ("/generate", "stop_sequence"): 1,
                     ("/generate", "error"): 1}
    generated = first["details"]["generated_tokens"] + stopped["details"]["generated_tokens"]
    assert sample(metrics, "nanoserve_generated_tokens_total") - tokens_before >= generated
    prompts = first["details"]["prompt_tokens"] + stopped["details"]["prompt_tokens"]
    assert sample(metrics, "nanoserve_prompt_tokens_total") - prompt_before == prompts + len(f"{FAULT} x")
    assert sample(metrics, "nanoserve_http_requests_total", route="/generate", method="POST", code="424") >= 1
    wait_until("idle gauges", lambda: idle(metrics), 10)


async def _first_line(lines: AsyncIterator[str], prefix: str) -> str:
    async for line in lines:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"stream ended before a line starting with {prefix!r}")


async def test_disconnects_count_as_cancelled_overload_as_rejected_and_gauges_return_to_zero(
    served: tuple[str, Metrics],
) -> None:
    url, metrics = served
    cancelled = sample(metrics, "nanoserve_requests_cancelled_total", route="/generate_stream")
    rejected = sample(metrics, "nanoserve_requests_rejected_total", reason="overloaded")
    too_many = sample(metrics, "nanoserve_http_requests_total", route="/generate_stream", method="POST",
                      code="429")
    before = finished(metrics)
    endless = body(max_new_tokens=100_000)
    # Line iterators are kept referenced: an abandoned one is finalized, which closes the connection.
    async with httpx.AsyncClient(base_url=url, timeout=30) as client, \
            client.stream("POST", "/generate_stream", json=endless) as running:
        assert running.status_code == 200
        running_lines = running.aiter_lines()
        await asyncio.wait_for(_first_line(running_lines, "data: "), 20)  # holds the only slot
        async with client.stream("POST", "/generate_stream", json=endless) as queued:
            assert queued.status_code == 200
            queued_lines = queued.aiter_lines()
            await asyncio.wait_for(_first_line(queued_lines, ": keep-alive"), 10)
            assert sample(metrics, "nanoserve_running_sequences") == 1
            assert sample(metrics, "nanoserve_waiting_requests") == 1
            assert sample(metrics, "nanoserve_kv_slots_in_use") == 1
            assert sample(metrics, "nanoserve_http_requests_in_flight", route="/generate_stream") == 2
            assert (await client.post("/generate_stream", json=endless)).status_code == 429
            # Both clients leave: the queued one, then the one holding the slot.
    wait_until("both disconnects to be seen", lambda: sample(
        metrics, "nanoserve_requests_cancelled_total", route="/generate_stream") - cancelled >= 2, 20)
    wait_until("idle gauges", lambda: idle(metrics), 20)
    assert sample(metrics, "nanoserve_requests_cancelled_total", route="/generate_stream") - cancelled == 2
    assert sample(metrics, "nanoserve_requests_rejected_total", reason="overloaded") - rejected == 1
    assert sample(metrics, "nanoserve_http_requests_total", route="/generate_stream", method="POST",
                  code="429") - too_many == 1
    after = finished(metrics)
    assert after[("/generate_stream", "cancelled")] - before.get(("/generate_stream", "cancelled"), 0) == 2
    assert sum(after.values()) - sum(before.values()) == 2  # the rejected one never started: no series
    assert sample(metrics, "nanoserve_kv_slots_capacity") == 1
