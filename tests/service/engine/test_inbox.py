"""The per-request inbox the engine's events arrive in."""

from __future__ import annotations

import asyncio

import pytest

from service.engine.inbox import Inbox


async def test_items_come_out_in_the_order_they_went_in() -> None:
    inbox: Inbox[int] = Inbox(asyncio.get_running_loop())
    for i in range(5):
        inbox.put(i)
    assert len(inbox) == 5
    assert [await inbox.get() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert len(inbox) == 0


async def test_a_waiting_reader_wakes_on_the_next_put() -> None:
    loop = asyncio.get_running_loop()
    inbox: Inbox[str] = Inbox(loop)
    reader = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    assert not reader.done()  # nothing to read yet: it waits
    loop.call_soon_threadsafe(inbox.put, "a")  # as the engine hands events over
    assert await asyncio.wait_for(reader, 5) == "a"


async def test_a_cancelled_reader_loses_nothing_and_the_next_one_gets_it() -> None:
    inbox: Inbox[int] = Inbox(asyncio.get_running_loop())
    reader = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    inbox.put(7)  # no waiter is left behind to swallow the wake-up
    inbox.put(8)
    assert await asyncio.wait_for(inbox.get(), 5) == 7
    assert await asyncio.wait_for(inbox.get(), 5) == 8


async def test_a_put_racing_a_cancellation_keeps_the_item() -> None:
    # The put resolves the waiter, then the reader is cancelled before it runs: the item stays.
    inbox: Inbox[int] = Inbox(asyncio.get_running_loop())
    reader = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    inbox.put(1)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert len(inbox) == 1
    assert await asyncio.wait_for(inbox.get(), 5) == 1
