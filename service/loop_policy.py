"""The event loop thread's CPU scheduling policy while it serves (Linux's SCHED_BATCH).

On a machine where the engine's threads use every core, each step's events wake the event loop
(and the sockets wake their clients) while the next step's forward is already running. Under
the default policy a thread that wakes up preempts a running one: an engine thread stops for
the loop's burst of work, and the other engine thread then waits for it at the next barrier of
the forward, so the step loses more than the CPU the loop used. SCHED_BATCH (same priority,
same share of the CPU, nothing else changes) keeps a waking thread from preempting: the loop
runs when a core frees or at the next scheduler tick. Measured with the serving bench
(docs/engine.md, "the event loop scheduled as a batch thread").
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("nanoserve.loop_policy")

POLICIES = ("batch", "normal")


def schedule_this_thread(policy: str) -> Callable[[], None] | None:
    """Put the calling thread (only it: threads it starts later inherit the policy, threads that
    exist keep theirs) under `policy`; returns an undo, or None when nothing changed
    ("normal", or a platform without SCHED_BATCH)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    batch = getattr(os, "SCHED_BATCH", None)
    if policy == "normal" or batch is None or not hasattr(os, "sched_setscheduler"):
        return None
    tid = threading.get_native_id()
    try:
        before, param = os.sched_getscheduler(tid), os.sched_getparam(tid)
        if before == batch:
            return None
        os.sched_setscheduler(tid, batch, os.sched_param(0))
    except OSError as exc:  # e.g. a seccomp profile that forbids it: serve all the same
        log.warning("could not schedule the event loop thread as a batch thread: %s", exc)
        return None

    def undo() -> None:
        try:
            os.sched_setscheduler(tid, before, param)
        except OSError as exc:
            log.warning("could not restore the event loop thread's scheduling policy: %s", exc)

    return undo
