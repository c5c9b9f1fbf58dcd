"""Where requests' grammars compile: one worker thread of its own, clients served in turn.

A compile is bounded (grammar_limits.py) but may still take a few hundred milliseconds of a core,
so it runs here and not on the encoder's pool or the event loop, one at a time so the engine keeps
a core; clients take turns (round robin), so one client's burst of grammars delays another's by
at most one compile. A request's compile counts in its client's share of the queue while it waits
or runs (the engine passes the room that client has left), and one whose caller goes away (the
awaiting task is cancelled: a client disconnect, a drain) is dropped before it starts; a compile
already running finishes alone, within its bounds, and its result is dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from nanoserve.engine.types import Overloaded
from nanoserve.engine.worker_priority import lower_thread_priority

__all__ = ["GrammarPool"]

T = TypeVar("T")


class GrammarPool:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: dict[str | None, deque[tuple[Future[Any], Callable[[], Any]]]] = {}
        self._turns: deque[str | None] = deque()  # clients with jobs, in the order they are served
        self._pending: dict[str | None, int] = {}  # jobs not done (waiting or running), per client
        self._thread: threading.Thread | None = None

    def pending(self, client: str | None = None) -> int:
        """Compiles waiting or running: `client`'s, or everyone's when None."""
        with self._cond:
            return self._pending.get(client, 0) if client is not None else sum(self._pending.values())

    async def run(self, fn: Callable[[], T], client: str | None, *, client_room: int, total_room: int) -> T:
        """fn's result, computed on the pool's thread. Raises Overloaded when `client` already has
        `client_room` compiles here, or everyone `total_room`."""
        fut: Future[T] = Future()
        with self._cond:
            mine, everyone = self._pending.get(client, 0), sum(self._pending.values())
            if client is not None and mine >= client_room:
                raise Overloaded(f"this client already has {mine} grammars compiling or requests waiting "
                                 "(max_waiting_per_client); retry later", retry_after_s=1.0)
            if everyone >= total_room:
                raise Overloaded(f"{everyone} grammars are compiling or waiting to (max_queue); retry later",
                                 retry_after_s=1.0)
            self._pending[client] = mine + 1
            fut.add_done_callback(lambda _: self._settled(client))
            if client not in self._jobs:
                self._jobs[client] = deque()
                self._turns.append(client)
            self._jobs[client].append((fut, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="nanoserve-grammars", daemon=True)
                self._thread.start()
            self._cond.notify()
        # Cancelling this await (the caller left) cancels `fut`: a job not yet started never runs.
        return await asyncio.wrap_future(fut)

    def _settled(self, client: str | None) -> None:
        with self._cond:
            left = self._pending.get(client, 0) - 1
            if left > 0:
                self._pending[client] = left
            else:
                self._pending.pop(client, None)

    def _next(self) -> tuple[Future[Any], Callable[[], Any]]:
        with self._cond:
            while not self._turns:
                self._cond.wait()
            client = self._turns.popleft()
            jobs = self._jobs[client]
            job = jobs.popleft()
            if jobs:
                self._turns.append(client)  # its next job after the other clients' next
            else:
                del self._jobs[client]
            return job

    def _work(self) -> None:
        lower_thread_priority()
        while True:
            fut, fn = self._next()
            if not fut.set_running_or_notify_cancel():
                continue  # its caller went away while it waited
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the awaiting request
                fut.set_exception(e)
