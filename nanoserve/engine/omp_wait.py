"""How long libgomp's idle threads spin before they sleep, for the processes `nanoserve` starts.

libgomp (torch's OpenMP runtime) reads GOMP_SPINCOUNT once, when it loads. By default a thread with
no work spins 300,000 `pause`s before it sleeps: 11 ms on an Intel Xeon with AMX (37 ns a pause),
less on AMD. Between two engine steps the OpenMP worker spins so while the engine thread runs
Python (scheduling, sampling, events) and the event loop serves HTTP; on a busy host that spinning
takes the cores they need. Measured on a shared 2-core Xeon, one stream of 600 tokens (shipped
checkpoint, medians of 3): default 2 threads 3.6 s, one thread 1.1 s; with SPIN_COUNT, 1.1 s and
1.0 s; beside a busy process 6.8 s and 1.6 s, with SPIN_COUNT 1.5 s and 1.6 s. A worker that slept
costs the next step a futex wake-up (tens of microseconds), once a step on the native backend.
"""

from __future__ import annotations

import os

# Spins before sleeping: about 0.7 ms at 37 ns a pause, 0.2 ms at 10 ns; longer than the gap
# between two steps of a quiet server, so a worker that is not needed elsewhere keeps spinning.
SPIN_COUNT = 20_000


def bound_openmp_spinning() -> None:
    """Set GOMP_SPINCOUNT to SPIN_COUNT unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set. Only a
    process that has not loaded torch yet is affected: call it first thing in an entry point."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
