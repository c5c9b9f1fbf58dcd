"""Per-request generation metrics, taken by wrapping the engine's `GenerationStream`.

Everything is measured where the client is: from HTTP arrival (so queueing shows in TTFT) to the
moment a token reaches the route. Each request ends in exactly one `finish_reason` series: the
engine's reason when its last event came through, `cancelled` when the consumer closed the stream
first (client disconnect or stop), `error` when the stream raised or ended without a last event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol

import anyio

from nanoserve.engine.types import FinishReason, TokenEvent, Usage
from nanoserve.server.metrics.instruments import Instruments

log = logging.getLogger(__name__)


class TrackableStream(Protocol):
    """The part of `GenerationStream` the tracker uses."""

    prompt_tokens: int
    cropped_tokens: int

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...

    async def aclose(self) -> None: ...


class StreamRecord:
    """Running state of one tracked request; records into the instruments as events pass."""

    def __init__(self, m: Instruments, route: str, arrival: float, prompt_tokens: int) -> None:
        self.m = m
        self.route = route
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.generated = 0
        self.started = time.perf_counter()  # ~ when the engine accepted the request
        self.last_token_at: float | None = None
        self.reason: str | None = None  # set once: the request's one finish-reason series

    def on_event(self, event: TokenEvent) -> None:
        now = time.perf_counter()
        if event.token_id is not None:
            self.generated += 1
            self.m.generated_tokens.inc()
            if self.last_token_at is None:
                self.m.ttft.observe(now - self.arrival)
            else:
                self.m.itl.observe(now - self.last_token_at)
            self.last_token_at = now
        if event.finish_reason is not None:
            if event.usage is not None:
                self._on_usage(event.usage)
            self.finish(FinishReason(event.finish_reason).value)

    def _on_usage(self, usage: Usage) -> None:
        # The engine's queue time starts at submission; add the HTTP part before it.
        self.m.queue.observe(self.started - self.arrival + usage.queue_time_s)

    def finish(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.m.finished.labels(route=self.route, finish_reason=reason).inc()
            self.m.request_prompt_tokens.observe(self.prompt_tokens)
            self.m.request_generated_tokens.observe(self.generated)


async def track_stream(
    m: Instruments, stream: TrackableStream, route: str, arrival: float, record: StreamRecord | None = None
) -> AsyncGenerator[TokenEvent, None]:
    """Yield `stream`'s events unchanged while recording them; closing this early closes `stream`.

    `record`: where to record (events the caller takes past this generator go to its `on_event`);
    a new one by default."""
    if record is None:
        record = StreamRecord(m, route, arrival, stream.prompt_tokens)
    m.prompt_tokens.inc(stream.prompt_tokens)
    m.cropped_tokens.inc(stream.cropped_tokens)
    try:
        async for event in stream:
            record.on_event(event)
            yield event
        record.finish(FinishReason.ERROR.value)  # no-op after a last event; without one, an engine bug
    except BaseException as exc:
        if record.reason is None:
            # GeneratorExit / CancelledError: the consumer (the client's connection) went away first.
            client_left = not isinstance(exc, Exception)
            if client_left:
                m.cancelled.labels(route=route).inc()
            record.finish(FinishReason.CANCELLED.value if client_left else FinishReason.ERROR.value)
            await _close_quietly(stream)
        raise


async def _close_quietly(stream: TrackableStream) -> None:
    # Shielded: under Starlette's cancel scopes every await of a cancelled task is cancelled again,
    # and this close is what frees the request's KV slot.
    with anyio.CancelScope(shield=True):
        try:
            await stream.aclose()
        except Exception:
            log.exception("closing a generation stream after its client left failed")
