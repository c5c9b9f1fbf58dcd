"""Server-sent events done right, for every streaming route (native and OpenAI).

- `Content-Type: text/event-stream`, `Cache-Control: no-cache`, `X-Accel-Buffering: no` (so nginx
  and friends do not buffer), `data: ` with a space, events separated by a blank line.
- While a request waits (queued behind full KV slots, or a slow step) a `: keep-alive` comment goes
  out every `keepalive_s`, so proxies and clients do not time the connection out.
- Everything that can be rejected is rejected before the response starts (the route awaits
  `Engine.generate` first). A failure after the 200 is a named `event: error` whose data is the
  shared error shape with a typed `code`, and then the stream ends.
- A client that disconnects cancels its generation: the response's `finally` closes the
  `GenerationStream`, which frees the engine slot within a step.
- Under the server's own protocol (`nanoserve/server/http/protocol.py`) a stream's events in the middle are
  written from the engine's per-step callback, without waking the response's task
  (`DirectEvents`); its start, its last event, errors and keep-alives go through ASGI.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from pydantic import BaseModel
from pydantic_core import to_json
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from nanoserve.engine.types import FinishReason, TokenEvent
from nanoserve.server.http.errors import error_body
from nanoserve.server.http.protocol import BodyWriter, body_writer

log = logging.getLogger("nanoserve.sse")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = b": keep-alive\n\n"


def sse_event(data: str | Mapping[str, Any] | BaseModel, event: str | None = None) -> bytes:
    """One SSE event. Strings are sent as they are (e.g. `[DONE]`); the rest as compact JSON."""
    head = f"event: {event}\n".encode() if event else b""
    if isinstance(data, str):
        # A newline inside data would end the field early: one `data:` line per line.
        return head + "".join(f"data: {line}\n" for line in data.split("\n")).encode() + b"\n"
    # JSON never holds a raw newline: one line, as bytes straight from the serializer (pydantic's
    # for a plain dict too, so it renders exactly as the same model would).
    payload = data.model_dump_json().encode() if isinstance(data, BaseModel) else to_json(data)
    return head + b"data: " + payload + b"\n\n"


class EventTemplate:
    """An event rendered once with one string field left open, then filled per call: a streamed
    chunk whose envelope (id, model, created, ...) is the same all stream long costs a JSON
    encoding of its text instead of building and dumping the models (about a tenth of the cost:
    docs/performance.md, levers). `render(text)` gives the full event; the result is its very bytes for any
    text (the field is encoded by the same serializer; tests compare them)."""

    _SLOT = "\x00nanoserve-slot\x00"  # a string no caller renders: its JSON is found exactly once

    def __init__(self, render: Callable[[str], bytes]) -> None:
        full, slot = render(self._SLOT), to_json(self._SLOT)
        self.head, found, self.tail = full.partition(slot)
        if not found or slot in self.tail:
            raise ValueError("the template's string field must appear exactly once")

    def __call__(self, text: str) -> bytes:
        return self.head + to_json(text) + self.tail


def sse_error(message: str, code: str, status: int = 500) -> bytes:
    """The `event: error` that ends a stream which already answered 200."""
    return sse_event(error_body(status, message, code), event="error")


Render = Callable[[TokenEvent], Iterable[bytes]]
# (message, code) -> the event that ends a failed stream, in the route's API dialect.
ErrorEvent = Callable[[str, str], bytes]


class DirectSource(Protocol):
    """A generation whose events in the middle of the stream can skip the response's body task
    (`generation.Generation`)."""

    def consume_directly(self, consumer: Callable[[TokenEvent], bool] | None) -> None:
        """Offer each event to `consumer` while the body waits for the next one; None stops it.
        An event it returns True for never reaches the body's iterator."""

    def observe(self, event: TokenEvent) -> None:
        """Record an event taken that way as the body iterator's wrappers would have (the metrics
        and the access log)."""


@dataclass(frozen=True)
class DirectEvents:
    """The generation's events offered past the body, and the render the body would have used."""

    source: DirectSource
    render: Render


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that sends keep-alives and always runs `on_close` (shielded).

    Keep-alives come from one loop timer per response, re-armed once per interval, not per event:
    when nothing was sent for `keepalive_s`, a short task sends the comment. Sends are serialized
    by a lock, so a keep-alive never interleaves with an event. (Waiting on each event under a
    deadline, through a pump task and a second queue, would cost per token a task switch, a queue
    hand-off and a timer, about a fifth of the event loop's streaming work.)

    A client that disconnects cancels the body (see `__call__`); cleanup that awaits must be
    shielded from that cancellation or it would never run and the engine slot would stay taken.

    With `direct` and the server's `BodyWriter` in the scope, events in the middle of the stream are
    rendered and written from the callback that delivers them (`_take`): per token that skips the
    task's wake-up, the generators between the inbox and here, and every `send` wrapper: about a
    quarter of the event loop's CPU a streamed token (docs/performance.md). The body's own
    path still sends the response's start, each event it is woken for, the last event and the end.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]] | None = None,
        headers: Mapping[str, str] | None = None,
        keepalive_s: float | None = None,
        direct: DirectEvents | None = None,
    ) -> None:
        super().__init__(content, headers={**SSE_HEADERS, **(headers or {})})
        self._content = content
        self._on_close = on_close
        self._keepalive_s = keepalive_s
        self._direct = direct
        self._writer: BodyWriter | None = None  # set from the scope (__call__)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        lock = asyncio.Lock()
        with _KeepAlive(send, lock, self._keepalive_s) as keepalive:
            direct = self._direct if self._writer is not None else None
            if direct is not None:
                direct.source.consume_directly(self._take(direct, self._writer, lock, keepalive))  # type: ignore[arg-type]
            try:
                async for chunk in self._content:
                    async with lock:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    keepalive.sent()
            finally:
                if direct is not None:
                    direct.source.consume_directly(None)
        async with lock:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    def _take(
        direct: DirectEvents, writer: BodyWriter, lock: asyncio.Lock, keepalive: _KeepAlive
    ) -> Callable[[TokenEvent], bool]:
        def take(event: TokenEvent) -> bool:
            # The last event (and an error, which is one) ends the stream: the body's path sends it,
            # then the trailer and the end. A keep-alive being sent, or a socket that is not free
            # (back-pressure, gone), likewise leaves the event to the body, whose send waits.
            if event.finish_reason is not None or lock.locked() or not writer.ready():
                return False
            data = b"".join(direct.render(event))
            direct.source.observe(event)
            if data:
                writer.write(data)
                keepalive.sent()
            return True

        return take

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._direct is not None:
            self._writer = body_writer(scope)
        # The body runs in its own task, as in Starlette, and for the same reason: a task resumes
        # through every frame it awaits from, and the request's own task is ~20 frames deep in
        # the server's, middlewares' and router's coroutines, which each token's wake-up would
        # pass through. Starlette starts it with a disconnect listener in an anyio task group;
        # two plain tasks do the same (the listener cancels the body when the client goes away)
        # for less of the event loop's CPU a request (docs/performance.md, levers).
        body = asyncio.ensure_future(self.stream_response(send))

        async def cancel_on_disconnect() -> None:
            await self.listen_for_disconnect(receive)  # Starlette's: returns at http.disconnect
            body.cancel()

        watcher = asyncio.ensure_future(cancel_on_disconnect())
        try:
            await asyncio.wait((body,))  # raises only if this task is cancelled
            if not body.cancelled():
                body.result()  # the body's own failure, if any
        finally:
            watcher.cancel()
            body.cancel()  # no-op once it has ended
            with anyio.CancelScope(shield=True):
                await asyncio.wait((body,))  # let it unwind before its iterator is closed
                aclose = getattr(self._content, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self._on_close is not None:
                    await self._on_close()


class _KeepAlive:
    """Sends `: keep-alive` whenever a response has sent nothing for `interval_s` seconds."""

    def __init__(self, send: Send, lock: asyncio.Lock, interval_s: float | None) -> None:
        self._send, self._lock, self._interval = send, lock, interval_s
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def __enter__(self) -> _KeepAlive:
        if self._interval:
            self._timer = self._loop.call_at(self._last + self._interval, self._tick)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()

    def sent(self) -> None:
        self._last = self._loop.time()

    def _tick(self) -> None:
        assert self._interval
        now, due = self._loop.time(), self._last + self._interval
        if now >= due:
            if self._task is None or self._task.done():  # else a ping is still waiting to send
                self._task = self._loop.create_task(self._ping())
            due = now + self._interval
        self._timer = self._loop.call_at(due, self._tick)

    async def _ping(self) -> None:
        try:
            async with self._lock:
                await self._send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
            self.sent()
        except Exception:  # the client is gone: the body loop sees it on its next send
            log.debug("keep-alive send failed", exc_info=True)


async def _encode(
    events: AsyncIterator[TokenEvent],
    render: Render,
    trailer: Iterable[bytes],
    ready: Callable[[], int] | None,
    error_event: ErrorEvent = sse_error,
) -> AsyncIterator[bytes]:
    # Events that are already waiting go out in one body chunk: one send through the ASGI stack
    # and one socket write (and one read at the client) for all of them, instead of one each.
    # Nothing waits for more to arrive, so this never delays a token: it only happens when a
    # stream is woken with several events in (the loop fell behind, or `--stream-interval`).
    out: list[bytes] = []
    finished = False
    try:
        async for event in events:
            if event.finish_reason is FinishReason.ERROR:
                # The engine's code where the request was at fault (its grammar failed).
                code = event.error_code or "generation_error"
                out.append(error_event(event.error or "generation failed", code))
                yield b"".join(out)
                return
            out.extend(render(event))
            if event.finish_reason is not None:
                finished = True
                break
            if out and (ready is None or not ready()):
                yield b"".join(out)
                out = []
    except Exception as exc:  # the stream already said 200: report in-band, never a traceback
        log.exception("stream failed after the response started")
        out.append(error_event(f"internal error while streaming: {type(exc).__name__}", "internal_error"))
        yield b"".join(out)
        return
    if not finished:
        out.append(error_event("the generation ended without a finish reason", "incomplete_generation"))
    else:
        out.extend(trailer)
    if out:
        yield b"".join(out)


def event_stream(
    events: AsyncIterator[TokenEvent],
    render: Render,
    *,
    keepalive_s: float,
    on_close: Callable[[], Awaitable[None]] | None = None,
    trailer: Iterable[bytes] = (),
    headers: Mapping[str, str] | None = None,
    ready: Callable[[], int] | None = None,
    direct: DirectSource | None = None,
    error_event: ErrorEvent = sse_error,
) -> EventStreamResponse:
    """Stream `events` as SSE: `render` turns each event into zero or more encoded SSE events.

    `trailer` is sent after the final event of a successful generation (OpenAI's `data: [DONE]`).
    An engine error event becomes `error_event(message, "generation_error")` (by default
    `event: error` with the shared shape) and ends the stream.
    `ready` (how many events are already waiting) lets those be sent in one body chunk.
    `direct`: the generation, whose events in the middle may skip the body (`DirectSource`);
    `render` serves both paths.
    """
    body = _encode(events, render, trailer, ready, error_event)
    how = DirectEvents(direct, render) if direct is not None else None
    return EventStreamResponse(body, on_close=on_close, headers=headers, keepalive_s=keepalive_s, direct=how)
