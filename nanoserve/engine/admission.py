"""Who enters the queue and who leaves it for a slot.

`admit` seats waiting requests, each step, in three passes:
- a group (n / best_of: one slot a choice) that has waited past `max_group_wait_s` goes first,
  oldest first, taking the slots it lacks from the clients holding the most (their newest
  sequences step aside and later go on drawing the same tokens); while it cannot fit even so,
  nothing overtakes it and the free slots stay its own;
- then every request that fits, in fair order (WaitingQueue's): a group that does not fit yet is
  passed over, not a wall that holds free slots idle behind a stream that may run for minutes;
- then one request of a client that waits holding no slot: the clients holding the most slots
  give up their newest sequences until it fits (its whole group), each keeping one at least.
A request is seated in the same pass that frees its slots, so its victims, put back first in
line, never take them back; a client that yields keeps a slot, so it never preempts back, and
once every waiting client holds a slot nobody is preempted again: the state is stable.

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
from nanoserve.engine.scheduler import Scheduler
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


def admit(waiting: WaitingQueue, scheduler: Scheduler, now: float, max_group_wait_s: float) -> None:
    """Seat what may be seated now (see the module docstring); called under the engine's lock."""
    if not len(waiting):  # most steps of a busy server: nothing to sort, nobody to preempt for
        return
    aged = [r for r in waiting.items if r.followers and now - r.submitted > max_group_wait_s]
    for group in sorted(aged, key=lambda r: r.submitted):
        if not _seat(waiting, scheduler, group, now, aged=True):
            return  # not overtaken: the slots free now wait for it
    while scheduler.free_slots:
        order = waiting.fair_order(scheduler.running)
        req = next((r for r in order if scheduler.fits(r)), None)
        if req is None:
            break
        scheduler.admit(waiting.take(req), now)
    holding = {r.client for r in scheduler.running}
    for req in waiting.fair_order(scheduler.running):
        if req.client is not None and req.client not in holding \
                and _seat(waiting, scheduler, req, now, aged=False):
            return  # one a step: the next step sees who holds what now


def _seat(waiting: WaitingQueue, scheduler: Scheduler, req: Request, now: float, *, aged: bool) -> bool:
    """Seat `req`'s group, preempting what it lacks (Scheduler.victims); False if it cannot."""
    victims = scheduler.victims(req, aged=aged)
    if victims is None:
        return False
    for victim in victims:
        scheduler.preempt(victim)
        waiting.push_front(victim)
    scheduler.admit(waiting.take(req), now)  # now: the slots just freed are its own, not its victims'
    return True
