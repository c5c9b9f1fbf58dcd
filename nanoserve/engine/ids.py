"""Request ids and default seeds, drawn without a system call per request.

`uuid.uuid4()` and `secrets.randbits()` read the OS's random source (getrandom), and CPython
releases the GIL around that call. On the event loop that is a hand-off per draw: the engine
thread, which wants the GIL between its native forwards, takes it, and the loop waits until the
engine's Python part of a step lets go. Profiled under 300 requests/s (cProfile, server main
thread), the two draws per request took 342 us of the loop's time each; a draw costs 0.5 us
when nothing else wants the GIL.

Neither needs to be unpredictable: ids must be unique (128 random bits from a generator seeded
once from the OS, and again in a forked child so two workers do not share a stream), and a
default seed only has to differ between requests. Draws are atomic under the GIL.
"""

from __future__ import annotations

import os
import random

_random = random.Random()


def _reseed() -> None:
    _random.seed(int.from_bytes(os.urandom(32), "big"))


_reseed()
os.register_at_fork(after_in_child=_reseed)


def new_id() -> str:
    """32 hex digits, like `uuid.uuid4().hex`."""
    return f"{_random.getrandbits(128):032x}"


def new_seed() -> int:
    """A seed for a request that gave none: 63 bits, so it is a valid non-negative int64."""
    return _random.getrandbits(63)
