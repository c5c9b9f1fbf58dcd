"""Background threads at a lower scheduling priority than the engine thread and the event loop.

Linux schedules threads on their own nice value, so a thread can lower its own priority: on a
two-core host the engine's step and the loop that streams its tokens then get a core first, and a
grammar's compile or a step's masks take the CPU those leave instead of taking a core from them
during a flood. Only for threads whose work runs without the GIL (llguidance releases it): a
low-priority thread descheduled while it holds the GIL stalls every other thread of the process
until the kernel runs it again, so the encoder's thread (Python code) keeps the server's priority.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10  # niceness above the process's: such threads take the engine's leftovers


def lower_thread_priority() -> None:
    """Make the calling thread yield its core to the engine and the event loop: its nice value
    becomes the process's plus BACKGROUND_NICE (where not Linux or not allowed, it stays)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0)
                       + BACKGROUND_NICE)
    except (OSError, AttributeError) as e:  # not Linux, or not allowed: serve at the same priority
        log.debug("background thread priority unchanged: %s", e)
