"""Timing a few variants against each other in one process on a noisy host."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def round_medians_s(
    fns: Mapping[str, Callable[[], object]], steps: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per call of each variant, per round: the median of `steps` calls, in `rounds` rounds
    that take turns between the variants.

    Every other round runs the variants in reverse order: with a fixed order, two builds of the
    same code alternating in one process came out ~1% apart in favour of the second (up to 6% in
    some runs), which is the size of the changes these comparisons judge."""
    medians: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for round_ in range(rounds):
        for name, fn in order if round_ % 2 == 0 else reversed(order):
            samples = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            medians[name].append(statistics.median(samples))
    return medians


def best_median_s(fns: Mapping[str, Callable[[], object]], steps: int, rounds: int) -> dict[str, float]:
    """Each variant's best round of round_medians_s (a round beside another tenant's burst does not
    count)."""
    return {name: min(medians) for name, medians in round_medians_s(fns, steps, rounds).items()}
