"""One generation as the HTTP layer runs it, shared by the native and the OpenAI routes.

    gen = await start_generation(request, engine, prompt, params)   # rejections raise here (4xx/503)
    result = await collect(request, gen)                             # non-streaming
    return sse_response(gen, render, settings)                      # streaming

`start_generation` enforces the server's prompt cap, calls `Engine.generate` (which raises
Overloaded / NotReady / InvalidRequest before anything is sent; the app's handlers map them to
429 / 503 / 422), and wraps the stream so metrics and the access log see every event.
`collect` cancels the generation when the client goes away and turns an engine error into a 500
with the shared error shape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from starlette.requests import Request

from nanoserve.engine.types import GRAMMAR_FAILED, FinishReason, InvalidRequest, SamplingParams, TokenEvent
from nanoserve.server.http.access_log import record_of
from nanoserve.server.http.errors import APIError
from nanoserve.server.settings import Settings
from nanoserve.server.streaming.clients import client_id
from nanoserve.server.streaming.encoding import encode, prompt_too_long
from nanoserve.server.streaming.sse import ErrorEvent, EventStreamResponse, Render, event_stream, sse_error

if TYPE_CHECKING:
    from nanoserve.engine.engine import Engine, GenerationStream

T = TypeVar("T")

@dataclass
class Generation:
    stream: GenerationStream
    events: AsyncIterator[TokenEvent]  # the stream's events, seen by metrics and the access log
    # What `events`' wrappers record of each event, for events taken past them
    # (`consume_directly`): metrics and the access log see every event either way.
    observers: tuple[Callable[[TokenEvent], None], ...] = ()

    def consume_directly(self, consumer: Callable[[TokenEvent], bool] | None) -> None:
        """`GenerationStream.consume_directly`; an event taken is recorded by `observe`."""
        self.stream.consume_directly(consumer)

    def observe(self, event: TokenEvent) -> None:
        for observer in self.observers:
            observer(event)

    async def aclose(self) -> None:
        """Cancel (if still running) and free the engine slot; safe to call twice."""
        aclose = getattr(self.events, "aclose", None)
        try:
            if aclose is not None:
                await aclose()
        finally:
            await self.stream.aclose()


@dataclass
class Completed:
    """A finished non-streaming generation."""

    events: list[TokenEvent] = field(default_factory=list)

    @property
    def final(self) -> TokenEvent:
        return self.events[-1]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def tokens(self) -> list[TokenEvent]:
        """Events that carry a generated token (the last one may not)."""
        return [e for e in self.events if e.token_id is not None]


def route_template(request: Request) -> str:
    path = getattr(request.scope.get("route"), "path", None)
    return str(path) if path is not None else request.url.path  # (building the URL costs ~10 us)


async def start_generation(
    request: Request,
    engine: Engine,
    prompt: str | list[int],
    params: SamplingParams,
    *,
    param: str = "inputs",
) -> Generation:
    """Validate the prompt against the server caps and submit it; raises before any response.

    `param` names the request field holding the prompt, for error messages.
    """
    return (await start_choices(request, engine, prompt, params, 1, param=param))[0]


async def start_choices(
    request: Request,
    engine: Engine,
    prompt: str | list[int],
    params: SamplingParams,
    n: int,
    *,
    param: str = "inputs",
) -> list[Generation]:
    """`start_generation` for `n` choices of one prompt (prefilled once: Engine.generate_choices)."""
    limit = request.app.state.settings.max_prompt_tokens
    if not prompt:
        raise APIError(422, f"{param} must not be empty", code="empty_prompt", param=param)
    client = client_id(request)
    # Cheap refusals first: a full queue or an over-long text is refused before any encoding.
    engine.check_admission(client)
    if isinstance(prompt, str):
        # Encode once, off the event loop when long, and hand the engine the ids: it would
        # otherwise encode the text again, on the loop.
        ids = await encode(engine, request.app.state.encode_queue, prompt, limit, param)
    elif len(prompt) > limit:
        raise prompt_too_long(len(prompt), limit, param)
    else:
        ids = prompt
    record = record_of(request)
    try:
        submit = engine.generate_choices(
            ids, params, n, request_id=record.request_id,
            stream_interval=request.app.state.settings.stream_interval, client=client,
        )
        # A grammar compiles first (engine/grammar_pool.py): a client gone meanwhile cancels it.
        streams = await (_unless_disconnected(request, submit) if params.grammar is not None else submit)
    except InvalidRequest as exc:
        if exc.param in (None, "inputs"):  # the engine's name for the prompt: the route's field
            exc.param = param
        raise
    record.started(streams[0].prompt_tokens, streams[0].cropped_tokens)
    arrival: float = request.state.arrival
    metrics, route = request.app.state.metrics, route_template(request)
    gens = []
    for stream in streams:
        stats = metrics.stream_record(stream, route, arrival)
        tracked = metrics.track_stream(stream, route, arrival, stats)
        gens.append(Generation(stream, _recorded(tracked, request),
                               observers=(stats.on_event, record.observe)))
    return gens


def sse_response(
    gen: Generation,
    render: Render,
    settings: Settings,
    *,
    trailer: Iterable[bytes] = (),
    headers: Mapping[str, str] | None = None,
    error_event: ErrorEvent = sse_error,
) -> EventStreamResponse:
    """Stream `gen` as server-sent events; events already waiting go out together, and under the
    server's own protocol those in the middle are written as they arrive (`sse.DirectEvents`)."""
    return event_stream(gen.events, render, keepalive_s=settings.keepalive_interval, on_close=gen.aclose,
                        trailer=trailer, headers=headers, ready=gen.stream.ready, direct=gen,
                        error_event=error_event)


async def _recorded(events: AsyncIterator[TokenEvent], request: Request) -> AsyncIterator[TokenEvent]:
    record = record_of(request)
    try:
        async for event in events:
            record.observe(event)
            yield event
    finally:
        if record.finish_reason is None:  # closed before its last event: the client went away
            record.finish_reason = FinishReason.CANCELLED.value
        # Close the metrics wrapper now, so a cancellation is counted deterministically rather than
        # whenever the garbage collector finalizes it.
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def _wait_for_disconnect(request: Request) -> None:
    # After the body is read, the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or a 499 (the work cancelled) when the client disconnects first."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        record_of(request).finish_reason = FinishReason.CANCELLED.value
        raise APIError(499, "client disconnected", code="client_disconnected")
    return task.result()


async def _drain(gen: Generation, out: Completed) -> None:
    async for event in gen.events:
        out.events.append(event)
        if event.finish_reason is not None:
            return


async def collect(request: Request, gen: Generation) -> Completed:
    """Run a generation to its end; a client disconnect cancels it and frees the slot."""
    return (await collect_all(request, [gen]))[0]


async def collect_all(request: Request, gens: Sequence[Generation]) -> list[Completed]:
    """Run generations to their ends, side by side (several prompts of one request); a client
    disconnect cancels them all and frees their slots."""
    outs = [Completed() for _ in gens]
    consumers = [asyncio.ensure_future(_drain(gen, out)) for gen, out in zip(gens, outs, strict=True)]
    everything: asyncio.Future[Any] = asyncio.gather(*consumers, return_exceptions=True)
    watch: asyncio.Future[Any] = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({everything, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        for consume in consumers:
            if not consume.done():
                consume.cancel()
        # Let the consumers finish unwinding first: closing a generator that is still running in
        # another task raises. Shielded, as cancellation of this handler must not skip the close.
        with anyio.CancelScope(shield=True):
            await asyncio.wait(consumers)
            for gen in gens:
                await gen.aclose()
    if any(c.cancelled() for c in consumers):
        record_of(request).finish_reason = FinishReason.CANCELLED.value
        raise APIError(499, "client disconnected", code="client_disconnected")
    for consume, out in zip(consumers, outs, strict=True):
        consume.result()  # re-raise an unexpected failure (answered as a clean 500)
        _check_finished(out)
    return outs


def _check_finished(out: Completed) -> None:
    if not out.events or out.final.finish_reason is None:
        raise APIError(500, "the generation ended without a finish reason", code="incomplete_generation")
    if out.final.finish_reason is FinishReason.ERROR and out.final.error_code == GRAMMAR_FAILED:
        # The request's own grammar failed while generating (a bound, or its vocabulary): its error.
        raise APIError(422, f"generation failed: {out.final.error}", code=GRAMMAR_FAILED)
    if out.final.finish_reason is FinishReason.ERROR:
        reason = out.final.error or "engine error"
        raise APIError(500, f"generation failed: {reason}", code="generation_error")


def elapsed_since_arrival(request: Request) -> float:
    return time.perf_counter() - float(request.state.arrival)


def check_limits(
    settings: Settings,
    *,
    max_new_tokens: tuple[str, int],
    stop: tuple[str, Sequence[str]] = ("stop", ()),
    top_n: tuple[str, int] = ("top_n_tokens", 0),
) -> None:
    """The server caps on a request, each given as (field name for the error, value)."""
    name, n = max_new_tokens
    if n > settings.max_new_tokens:
        raise APIError(422, f"{name} is {n}, more than this server's limit of {settings.max_new_tokens}",
                       code="max_new_tokens_too_large", param=name)
    name, stops = stop
    if len(stops) > settings.max_stop_sequences:
        raise APIError(422, f"{name} has {len(stops)} stop sequences, more than this server's limit of "
                       f"{settings.max_stop_sequences}", code="too_many_stop_sequences", param=name)
    name, n = top_n
    if n > settings.max_top_n_tokens:
        raise APIError(422, f"{name} is {n}, more than this server's limit of {settings.max_top_n_tokens}",
                       code="top_n_tokens_too_large", param=name)
