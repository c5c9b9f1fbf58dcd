"""Timing a few variants against each other in one process on a noisy host."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def best_median_s(fns: dict[str, Callable[[], object]], steps: int, rounds: int) -> dict[str, float]:
    """Seconds per call of each variant: the median of `steps` calls, the best of `rounds` rounds
    that take turns between the variants (a round beside another tenant's burst does not count).

    Every other round runs the variants in reverse order: with a fixed order, two builds of the
    same code alternating in one process came out ~1% apart in favour of the second (session 15,
    AMD Zen 4), which is the size of the changes these comparisons judge."""
    best = dict.fromkeys(fns, float("inf"))
    order = list(fns.items())
    for round_ in range(rounds):
        for name, fn in order if round_ % 2 == 0 else reversed(order):
            samples = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            best[name] = min(best[name], statistics.median(samples))
    return best
