"""A request's events on their way from the engine to the coroutine that streams them."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


class Inbox(Generic[T]):
    """Items in arrival order for one reader, on one event loop; unbounded.

    What asyncio.Queue does for this one-writer, one-reader case, without the rest: its maxsize
    checks, its deque of waiting getters and the `join()` bookkeeping every put pays for (it
    clears an Event each time). Putting an event into each stream's queue was 16% of the event
    loop's time while it streamed to 32 clients (py-spy --gil, 124 tokens a second per client).

    `wake_every` > 1 lets a waiting reader sleep until that many items are in (the first item
    ever, and any item `urgent` says is, wake it at once): a stream then wakes, and writes to
    its socket, once per `wake_every` tokens instead of once per token (`--stream-interval`).

    `consume_directly(consumer)` offers items to a plain callback while the reader waits on an
    empty inbox (streams write their events from there, without waking their task).

    All of it runs on the loop's thread only (the engine hands events over with
    `call_soon_threadsafe`).
    """

    __slots__ = ("_consumer", "_items", "_loop", "_started", "_urgent", "_waiter", "_wake_every")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        wake_every: int = 1,
        urgent: Callable[[T], bool] | None = None,
    ) -> None:
        if wake_every < 1:
            raise ValueError(f"wake_every must be at least 1, not {wake_every}")
        self._items: deque[T] = deque()
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None
        self._wake_every = wake_every
        self._urgent = urgent
        self._started = False  # has any item been put yet (the first one always wakes the reader)
        self._consumer: Callable[[T], bool] | None = None

    def consume_directly(self, consumer: Callable[[T], bool] | None) -> None:
        """While the reader waits on an empty inbox, offer each item to `consumer` first: an item it
        takes (returns True) is never queued and wakes nobody. One it declines (or raises on) is
        queued and wakes the reader as usual, and so is every later item until the reader has taken
        them all and waits again: items reach the consumer or the reader in their order. None stops
        it. Only for a reader woken on every item: one woken every `wake_every` wants them batched."""
        if self._wake_every == 1:
            self._consumer = consumer

    def put(self, item: T) -> None:
        consumer, waiter = self._consumer, self._waiter
        if consumer is not None and waiter is not None and not self._items and not waiter.done():
            try:
                taken = consumer(item)
            except Exception:  # a bug; the reader's own path then handles the item
                log.exception("an inbox consumer failed; the item goes to the reader")
                taken = False
            if taken:
                self._started = True
                return
        self._items.append(item)
        first, self._started = not self._started, True
        waiter = self._waiter
        if waiter is None:
            return
        if (
            not first
            and len(self._items) < self._wake_every
            and (self._urgent is None or not self._urgent(item))
        ):
            return  # let the reader sleep until a full batch (or an urgent item) is in
        self._waiter = None
        if not waiter.done():  # a reader cancelled meanwhile has no use for the wake-up
            waiter.set_result(None)

    async def get(self) -> T:
        while not self._items:
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:  # cancelled before any put: forget it
                    self._waiter = None
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)
