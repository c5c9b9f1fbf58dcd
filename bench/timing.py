"""Timing a few variants against each other in one process on a noisy host."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def best_median_s(fns: dict[str, Callable[[], object]], steps: int, rounds: int) -> dict[str, float]:
    """Seconds per call of each variant: the median of `steps` calls, the best of `rounds` rounds
    that take turns between the variants (a round beside another tenant's burst does not count)."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            samples = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            best[name] = min(best[name], statistics.median(samples))
    return best
