"""The async iterator a caller gets from `Engine.generate`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nanoserve.engine.request import Request
from nanoserve.engine.types import TokenEvent


class GenerationStream:
    """Yields a request's TokenEvents; the last carries finish_reason and usage.

    Closing it early (`aclose()`, or cancelling the task awaiting it) cancels the request: the
    engine frees its slot at the start of its next step.
    """

    def __init__(self, request: Request, cancel: Callable[[Request], None]) -> None:
        self._request = request
        self._cancel = cancel
        self._done = False
        self.request_id = request.request_id
        self.prompt_tokens = len(request.prompt_ids)
        self.cropped_tokens = request.cropped
        self.seed = request.seed

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            event = await self._request.queue.get()
        except asyncio.CancelledError:
            self._close()
            raise
        if event.finish_reason is not None:
            self._done = True
        return event

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._cancel(self._request)

    def consume_directly(self, consumer: Callable[[TokenEvent], bool] | None) -> None:
        """Offer events to `consumer` while the reader waits for the next one (see
        `Inbox.consume_directly`); events it takes are not returned by `__anext__`."""
        self._request.queue.consume_directly(consumer)

    def ready(self) -> int:
        """Events already here: the next that many `__anext__` calls return without waiting."""
        return len(self._request.queue)

    @property
    def done(self) -> bool:
        return self._done

    def __del__(self) -> None:
        # Dropped without aclose() (e.g. `break` out of `async for`): nobody will read the rest,
        # so free the slot. Only the flag is set here; the engine reads it every step.
        if not self._done:
            self._request.cancelled = True
