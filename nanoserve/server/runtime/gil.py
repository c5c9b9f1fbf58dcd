"""How long a thread keeps the GIL while another waits for it (sys.setswitchinterval), per device:
the server sets it for its own process at start-up (`--gil-switch-interval`).

The engine thread and the event loop that streams its tokens share one interpreter. On CPU the
native step runs each forward in C with the GIL released, so the loop takes it whenever it needs
it. On a GPU the torch backend's decode step is Python launching kernels: the engine thread holds
the GIL nearly all the time, and a waiting thread gets it only when the holder is made to drop it,
after the switch interval (Python's default 5 ms). Every token the loop writes then waited up to
that long: on an NVIDIA H200 one stream through HTTP took 8.76 ms a token against 3.94 ms
in-process, at 124M bf16. A shorter interval hands the GIL over sooner, at the cost of more
hand-offs for the thread that had it (docs/performance.md: one stream through HTTP 1.2-1.4x on an
H200, 64 streams no difference shown; an in-process engine beside a busy loop of its own slower);
where the loop rarely waits (CPU), Python's default stays.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)

GPU_SWITCH_INTERVAL_S = 0.0005  # 0.5 ms on GPUs (see above); Python's own elsewhere


def apply_switch_interval(seconds: float, device: str) -> float:
    """Set the process's GIL switch interval: `seconds` if above 0, else GPU_SWITCH_INTERVAL_S on a
    CUDA device and Python's own elsewhere. Returns the interval in effect."""
    chosen = seconds if seconds > 0 else GPU_SWITCH_INTERVAL_S if device.startswith("cuda") else 0.0
    if chosen > 0 and chosen != sys.getswitchinterval():
        sys.setswitchinterval(chosen)
        log.info("engine: GIL switch interval %.2g ms", 1e3 * chosen)
    return sys.getswitchinterval()
