"""The per-request inbox the engine's events arrive in."""

from __future__ import annotations

import asyncio

import pytest

from nanoserve.engine.inbox import Inbox


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


async def test_a_direct_consumer_takes_items_only_while_the_reader_waits_on_an_empty_inbox() -> None:
    inbox: Inbox[int] = Inbox(asyncio.get_running_loop())
    taken: list[int] = []
    inbox.consume_directly(lambda item: taken.append(item) is None)
    inbox.put(0)  # no reader waiting yet: queued
    reader = asyncio.ensure_future(inbox.get())
    assert await asyncio.wait_for(reader, 5) == 0
    reader = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)  # the reader now waits on an empty inbox
    inbox.put(1)
    inbox.put(2)
    assert taken == [1, 2] and len(inbox) == 0 and not reader.done()  # taken: nobody was woken
    inbox.consume_directly(None)
    inbox.put(3)
    assert await asyncio.wait_for(reader, 5) == 3
    assert taken == [1, 2]


async def test_after_a_declined_item_later_ones_queue_behind_it_until_the_reader_catches_up() -> None:
    inbox: Inbox[int] = Inbox(asyncio.get_running_loop())
    taken: list[int] = []

    def take(item: int) -> bool:
        if item == 2:
            return False  # e.g. the socket is applying back-pressure
        taken.append(item)
        return True

    inbox.consume_directly(take)
    reader = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    for item in (1, 2, 3, 4):
        inbox.put(item)
    # 2 woke the reader; 3 and 4 came before it ran, so they wait behind 2, in order.
    assert taken == [1]
    assert await asyncio.wait_for(reader, 5) == 2
    assert [await inbox.get(), await inbox.get()] == [3, 4]
    reader = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    inbox.put(5)  # the reader has caught up and waits again: direct once more
    assert taken == [1, 5] and not reader.done()
    reader.cancel()


async def test_a_consumer_that_raises_leaves_the_item_to_the_reader() -> None:
    inbox: Inbox[int] = Inbox(asyncio.get_running_loop())

    def broken(item: int) -> bool:
        raise RuntimeError("a bug")

    inbox.consume_directly(broken)
    reader = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    inbox.put(9)
    assert await asyncio.wait_for(reader, 5) == 9


async def test_no_direct_consumer_for_a_reader_woken_every_few_items() -> None:
    inbox: Inbox[int] = Inbox(asyncio.get_running_loop(), wake_every=4)
    taken: list[int] = []
    inbox.consume_directly(lambda item: taken.append(item) is None)
    reader = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    for item in range(4):
        inbox.put(item)
    assert taken == []  # it wants its items batched
    assert await asyncio.wait_for(reader, 5) == 0
