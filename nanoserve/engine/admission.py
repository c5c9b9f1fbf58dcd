"""Whether the waiting queue has room for one more request, and how long a refused one should wait.

The queue is bounded as a whole by `max_queue` and per client by its share
(`EngineConfig.client_queue_share`), counting only what waits beyond the free slots. A request
refused for room gets `Overloaded` with a retry-after: the time until a running request is expected
to end and free a slot. The engine checks its own state (not running, shutting down) before these
and calls them under its lock when it queues.
"""

from __future__ import annotations

from collections.abc import Callable

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.request import Request
from nanoserve.engine.types import Overloaded
from nanoserve.engine.waiting_queue import WaitingQueue


def check_queue_room(
    queue: WaitingQueue, free_slots: list[int], config: EngineConfig, client: str | None,
    retry_after_s: Callable[[], float],
) -> None:
    """Raise Overloaded when the queue, or `client`'s share of it, is full."""
    waiting = len(queue)
    if waiting >= config.max_queue:
        raise Overloaded(
            f"{waiting} requests are already waiting (max_queue {config.max_queue}); "
            "retry later",
            retry_after_s=retry_after_s(),
        )
    # The client's share counts what waits beyond the free slots: requests queued a moment
    # before the engine thread admits them to free slots are not the queue (a snapshot; the
    # engine thread owns the slots).
    mine, cap = queue.by_client.get(client, 0), config.client_queue_share()
    if client is not None and mine - len(free_slots) >= cap:
        raise Overloaded(
            f"this client already has {mine} requests waiting (max_waiting_per_client {cap}); "
            "retry later",
            retry_after_s=retry_after_s(),
        )


def expected_wait_s(running: list[Request], step_s: float) -> float:
    """`Engine.expected_wait_s` from the running requests and the recent step time."""
    left = [r.params.max_new_tokens - len(r.generated) for r in list(running)]
    if not left:
        return 1.0
    return max(1.0, min(left) * step_s)
