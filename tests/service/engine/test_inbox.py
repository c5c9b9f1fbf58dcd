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


async def test_wake_every_lets_the_reader_sleep_until_a_batch_is_in() -> None:
    # The first item wakes the reader at once (time to first token), later ones only in fours,
    # and an urgent one (a stream's last event) at once.
    inbox: Inbox[int] = Inbox(asyncio.get_running_loop(), wake_every=4, urgent=lambda i: i < 0)

    async def woken_with(puts: list[int]) -> int:
        reader = asyncio.ensure_future(inbox.get())
        await asyncio.sleep(0)
        for i, item in enumerate(puts):
            assert not reader.done(), f"woken after {i} of {puts}"
            inbox.put(item)
            await asyncio.sleep(0)
        await asyncio.wait_for(reader, 5)
        return len(inbox) + 1  # what it was woken with: the item it returned and the rest

    assert await woken_with([1]) == 1
    assert await woken_with([2, 3, 4, 5]) == 4
    # The reader took one of the four; the other three are read without waiting.
    assert [await inbox.get() for _ in range(3)] == [3, 4, 5]
    assert await woken_with([6, -1]) == 2
    assert [await inbox.get()] == [-1]


async def test_wake_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="wake_every must be at least 1"):
        Inbox(asyncio.get_running_loop(), wake_every=0)
