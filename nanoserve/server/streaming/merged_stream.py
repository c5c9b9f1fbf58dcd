"""Several generations streamed as one SSE response: the prompts of one completions request.

Each generation's events are rendered by its own renderer (its choice `index`) in the order they
arrive. A generation's last event renders its finish chunk, but the stream as a whole ends only
with the last generation's: `event_stream` ends at the first event that carries a finish reason,
so the others are passed on without it (their renderer still sees the original). A failure in
any of them ends the stream with the error event, and closing the response cancels them all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace

from nanoserve.engine.types import FinishReason, TokenEvent
from nanoserve.server.settings import Settings
from nanoserve.server.streaming.generation import Generation
from nanoserve.server.streaming.sse import EventStreamResponse, Render, event_stream


class MergedStream:
    """The merged events (`events`) and the render that dispatches each to its generation's
    renderer; `closing` runs once every generation has finished (e.g. a summed usage chunk)."""

    def __init__(self, gens: Sequence[Generation], renders: Sequence[Render],
                 closing: Callable[[list[TokenEvent]], Iterable[bytes]]) -> None:
        self.gens, self.renders, self.closing = list(gens), list(renders), closing
        self.current: tuple[int, TokenEvent] | None = None  # what `render` is called for next
        self.finals: list[TokenEvent] = []
        self.pumps: list[asyncio.Task[None]] = []

    async def events(self) -> AsyncIterator[TokenEvent]:
        queue: asyncio.Queue[tuple[int, TokenEvent | BaseException]] = asyncio.Queue()

        async def pump(i: int, gen: Generation) -> None:
            try:
                async for event in gen.events:
                    await queue.put((i, event))
            except Exception as exc:  # reported in-band by event_stream, as any stream's failure
                await queue.put((i, exc))

        self.pumps = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.gens)]
        remaining = len(self.gens)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            self.current = (i, item)
            if item.finish_reason is FinishReason.ERROR:
                yield item  # the error event ends the whole stream
                return
            if item.finish_reason is not None:
                remaining -= 1
                self.finals.append(item)
                if remaining:
                    item = replace(item, finish_reason=None)
            yield item

    def render(self, event: TokenEvent) -> Iterator[bytes]:
        assert self.current is not None
        i, original = self.current
        yield from self.renders[i](original)
        if len(self.finals) == len(self.gens) and original.finish_reason is not None:
            yield from self.closing(self.finals)

    async def aclose(self) -> None:
        for task in self.pumps:
            task.cancel()
        for task in self.pumps:
            with contextlib.suppress(BaseException):
                await task
        for gen in self.gens:
            await gen.aclose()


def merged_sse_response(stream: MergedStream, settings: Settings, *, trailer: Iterable[bytes] = (),
                        headers: Mapping[str, str] | None = None) -> EventStreamResponse:
    """`stream` as one SSE response (no direct writes: the events come through one task)."""
    return event_stream(stream.events(), stream.render, keepalive_s=settings.keepalive_interval,
                        on_close=stream.aclose, trailer=trailer, headers=headers)
