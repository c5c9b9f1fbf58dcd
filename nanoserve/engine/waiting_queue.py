"""The queue of requests not yet admitted, and who goes next: `WaitingQueue`.

Fair order between clients (fewest running first, then round robin), preempted requests put
back at the front, and the reaping of waiting requests that were cancelled or ran out of time,
including a waiting group whose leader was cancelled (a follower takes its place). The engine
holds one, under its lock; who of it is seated, and when, is admission.py's `admit`.
"""

from __future__ import annotations

from collections import Counter, deque

from nanoserve.engine.request import Request
from nanoserve.engine.types import FinishReason, TokenEvent


class WaitingQueue:
    """Requests not yet admitted, oldest first; guarded by the engine's lock.

    Admission is fair between clients: the next request admitted is the oldest one of the client
    with the fewest requests running, and among those the client served longest ago (round robin),
    so a caller that queued many requests does not push a newcomer's first token behind all of
    them. With one client (or none given) it is plain FIFO.
    """

    def __init__(self) -> None:
        self.items: deque[Request] = deque()
        self.by_client: Counter[str | None] = Counter()
        self._admissions = 0
        self._last_admitted: dict[str | None, int] = {}  # of clients with requests waiting

    def __len__(self) -> int:
        return len(self.items)

    def append(self, req: Request) -> None:
        self.items.append(req)
        self.by_client[req.client] += 1

    def remove(self, req: Request) -> None:
        self.items.remove(req)
        self._forget(req)

    def _forget(self, req: Request) -> None:
        self.by_client[req.client] -= 1
        if not self.by_client[req.client]:
            del self.by_client[req.client]
            self._last_admitted.pop(req.client, None)  # an idle client starts afresh

    def push_front(self, req: Request) -> None:
        """A preempted request: first in line among its client's."""
        self.items.appendleft(req)
        self.by_client[req.client] += 1

    def fair_order(self, running: list[Request]) -> list[Request]:
        """Every waiting request, the next to admit first (see the class docstring)."""
        if len(self.by_client) == 1:
            return list(self.items)
        held = Counter(r.client for r in running)
        last = self._last_admitted
        # sorted is stable: the oldest first among equal keys.
        return sorted(self.items, key=lambda r: (held[r.client], last.get(r.client, -1)))

    def pop_fair(self, running: list[Request]) -> Request:
        """Take the next request to admit (see the class docstring)."""
        return self.take(self.fair_order(running)[0])

    def take(self, req: Request) -> Request:
        """Take `req` out to be admitted: its client counts as served now (round robin)."""
        self.items.remove(req)
        self._admissions += 1
        self._last_admitted[req.client] = self._admissions
        self._forget(req)
        return req

    def reap(self, now: float) -> list[tuple[Request, TokenEvent]]:
        """Remove cancelled and expired requests, returning their final events."""
        out: list[tuple[Request, TokenEvent]] = []
        for req in list(self.items):
            if req.followers and self._reap_followers(req, now, out):
                continue  # a follower took the cancelled leader's place
            if req.cancelled:
                out.append((req, req.final_event(FinishReason.CANCELLED, now)))
            elif req.deadline is not None and now >= req.deadline:
                msg = f"deadline of {req.params.deadline_s}s passed before the request was scheduled"
                out.append((req, req.final_event(FinishReason.ERROR, now, error=msg)))
            else:
                continue
            self.remove(req)
        return out

    def _reap_followers(self, leader: Request, now: float, out: list[tuple[Request, TokenEvent]]) -> bool:
        """A waiting group's cancelled followers end now; if the leader itself was cancelled,
        the first follower left takes its place in the queue, leading the rest. A passed
        deadline (the same for the whole group) ends them all with the leader."""
        expired = leader.deadline is not None and now >= leader.deadline
        for follower in list(leader.followers):
            if follower.cancelled or expired:
                leader.followers.remove(follower)
                if follower.cancelled:
                    out.append((follower, follower.final_event(FinishReason.CANCELLED, now)))
                else:
                    msg = f"deadline of {follower.params.deadline_s}s passed before the request was scheduled"
                    out.append((follower, follower.final_event(FinishReason.ERROR, now, error=msg)))
        if leader.cancelled and leader.followers:
            heir, *rest = leader.followers
            leader.followers = []
            heir.leader, heir.followers = None, rest
            for follower in rest:
                follower.leader = heir
            self.items[self.items.index(leader)] = heir
            self.by_client[heir.client] += 1  # the leader's removal below takes one off
            out.append((leader, leader.final_event(FinishReason.CANCELLED, now)))
            self._forget(leader)
            return True
        return False
