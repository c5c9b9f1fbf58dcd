"""The thread tuner measures both thread counts per forward size and keeps the faster one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import nanoserve.engine.threads as threads_module
from nanoserve.engine.threads import ALL_THREADS_FROM, BLOCK, ROUNDS, SURE_ALL_THREADS_S, ThreadTuner

REPO = Path(__file__).resolve().parents[2]
TUNING = 2 * ROUNDS * BLOCK  # forwards the tuner runs to measure both counts
MS = 1e-3


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeClock]:
    fake = FakeClock()
    monkeypatch.setattr(threads_module, "time", SimpleNamespace(perf_counter=fake.perf_counter))
    before = torch.get_num_threads()
    yield fake
    torch.set_num_threads(before)


def run(tuner: ThreadTuner, clock: FakeClock, tokens: int, cost: dict[int, float]) -> int:
    """One forward of `tokens` tokens that takes cost[threads] seconds; returns the threads used."""
    tuner.begin(tokens)
    used = torch.get_num_threads()
    clock.now += cost[used]
    tuner.end()
    return used


def tuned(clock: FakeClock, tokens: int, cost: dict[int, float]) -> ThreadTuner:
    """A two-thread tuner that has measured forwards of `tokens` tokens costing `cost` and chosen."""
    tuner = ThreadTuner(2)
    for _ in range(TUNING):
        run(tuner, clock, tokens, cost)
    return tuner


def test_alternates_then_keeps_the_faster_count_per_size(clock: FakeClock) -> None:
    tuner = ThreadTuner(2)
    small = {1: 0.4 * MS, 2: 0.7 * MS}  # one thread wins for small forwards
    medium = {1: 1.9 * MS, 2: 1.2 * MS}  # both threads win, and both were tried
    used = [run(tuner, clock, 1, small) for _ in range(TUNING)]
    assert used == ([2] * BLOCK + [1] * BLOCK) * ROUNDS  # both, in turns, equally
    assert tuner.choices() == {1: 1}
    assert {run(tuner, clock, 1, small) for _ in range(20)} == {1}
    used = [run(tuner, clock, 64, medium) for _ in range(TUNING)]
    assert sorted(used) == [1] * (TUNING // 2) + [2] * (TUNING // 2)
    assert tuner.choices() == {1: 1, 64: 2}
    assert {run(tuner, clock, 50, medium) for _ in range(5)} == {2}  # 50 tokens round up to 64


def test_long_forwards_keep_every_thread_without_a_turn_on_one(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(threads_module, "FIRST_RETUNE", 10)
    tuner = ThreadTuner(2)
    # Even a (made-up) faster single thread is never tried once every thread takes this long.
    long = {1: SURE_ALL_THREADS_S / 2, 2: SURE_ALL_THREADS_S}
    used = [run(tuner, clock, 16, long) for _ in range(BLOCK)]
    assert used == [2] * BLOCK
    assert tuner.choices() == {16: 2}
    # Re-measuring confirms it the same way: one block, never a forward on one thread.
    assert {run(tuner, clock, 16, long) for _ in range(10 + TUNING)} == {2}
    # Just under the mark, one thread gets its turns (and wins here).
    short = {1: SURE_ALL_THREADS_S / 2, 2: 0.99 * SURE_ALL_THREADS_S}
    used = [run(tuner, clock, 4, short) for _ in range(TUNING)]
    assert sorted(used) == [1] * (TUNING // 2) + [2] * (TUNING // 2)
    assert tuner.choices() == {4: 1, 16: 2}


def test_one_slow_forward_does_not_skip_the_turns_on_one_thread(clock: FakeClock) -> None:
    tuner = ThreadTuner(2)
    used = []
    for i in range(TUNING):
        tuner.begin(8)
        used.append(torch.get_num_threads())
        # The first timed forward on every thread is an outlier past the mark; the rest are short.
        clock.now += 0.5 if i == 1 else (1.0 * MS if used[-1] == 1 else 1.2 * MS)
        tuner.end()
    assert sorted(used) == [1] * (TUNING // 2) + [2] * (TUNING // 2)
    assert tuner.choices() == {8: 1}


def test_large_forwards_always_use_every_thread(clock: FakeClock) -> None:
    tuner = ThreadTuner(2)
    used = {run(tuner, clock, ALL_THREADS_FROM, {1: 0.001, 2: 0.5}) for _ in range(2 * TUNING)}
    assert used == {2}  # never measured on one thread, even if that looked faster


def test_one_slow_outlier_does_not_decide(clock: FakeClock) -> None:
    tuner = ThreadTuner(2)
    one_thread_forwards = 0
    for _ in range(TUNING):
        tuner.begin(8)
        used = torch.get_num_threads()
        one_thread_forwards += used == 1
        # The second one-thread forward is the first one timed: make it an outlier.
        outlier = used == 1 and one_thread_forwards == 2
        clock.now += 0.5 if outlier else (1.0 * MS if used == 1 else 1.2 * MS)
        tuner.end()
    assert tuner.choices() == {8: 1}


def test_the_forward_after_a_switch_is_not_timed(clock: FakeClock) -> None:
    # Every switch to two threads costs one slow forward (waking the workers); settled forwards
    # are faster on two. Timing the switch would pick one thread.
    tuner = ThreadTuner(2)
    previous = 1
    for _ in range(TUNING):
        tuner.begin(8)
        used = torch.get_num_threads()
        clock.now += 4.0 * MS if (used == 2 and previous == 1) else (1.0 * MS if used == 2 else 1.2 * MS)
        previous = used
        tuner.end()
    assert tuner.choices() == {8: 2}


def test_remeasures_after_a_while(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads_module, "FIRST_RETUNE", 10)
    tuner = tuned(clock, 4, {1: 0.1 * MS, 2: 0.2 * MS})
    assert tuner.choices() == {4: 1}
    for _ in range(10):
        run(tuner, clock, 4, {1: 0.1 * MS, 2: 0.2 * MS})
    # The machine changed (say another process left): the next measurement picks 2 threads.
    for _ in range(TUNING + 1):
        run(tuner, clock, 4, {1: 0.3 * MS, 2: 0.1 * MS})
    assert tuner.choices() == {4: 2}


def _forwards_until_measuring(tuner: ThreadTuner, clock: FakeClock, cost: dict[int, float]) -> int:
    """Forwards of 4 tokens run on the chosen count before the tuner measures again."""
    count = 0
    while True:
        tuner.begin(4)
        if tuner.choices().get(4) is None:  # measuring: the choice was dropped
            clock.now += cost[torch.get_num_threads()]
            tuner.end()
            return count
        clock.now += cost[torch.get_num_threads()]
        tuner.end()
        count += 1


def test_a_confirmed_choice_is_remeasured_less_often_a_changed_one_soon(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(threads_module, "FIRST_RETUNE", 10)
    monkeypatch.setattr(threads_module, "RETUNE_AFTER", 40)
    tuner = ThreadTuner(2)
    one_wins, two_wins = {1: 0.1 * MS, 2: 0.2 * MS}, {1: 0.2 * MS, 2: 0.1 * MS}

    def measure(cost: dict[int, float]) -> None:
        for _ in range(TUNING - 1):  # the forward that started the measurement was the first
            run(tuner, clock, 4, cost)

    for _ in range(TUNING):
        run(tuner, clock, 4, one_wins)
    gaps = []
    for _ in range(4):  # the same answer each time: 10, 20, 40, then capped at 40
        gaps.append(_forwards_until_measuring(tuner, clock, one_wins))
        measure(one_wins)
        assert tuner.choices() == {4: 1}
    assert gaps == [10, 20, 40, 40]
    # The machine changed: the chosen count's forwards doubled, so the size is measured again as
    # soon as WATCH of them show it (not after the 40 of the re-measurement period); the new choice
    # is measured again after FIRST_RETUNE forwards.
    assert _forwards_until_measuring(tuner, clock, two_wins) == threads_module.WATCH
    measure(two_wins)
    assert tuner.choices() == {4: 2}
    assert _forwards_until_measuring(tuner, clock, two_wins) == 10


def test_a_failed_forward_is_not_counted(clock: FakeClock) -> None:
    tuner = ThreadTuner(2)
    run(tuner, clock, 1, {1: 0.2 * MS, 2: 0.1 * MS})  # a block's first forward: not timed anyway
    tuner.begin(1)
    clock.now += 100.0  # a timed forward that raised: end() never runs
    for _ in range(TUNING):
        run(tuner, clock, 1, {1: 0.2 * MS, 2: 0.1 * MS})
    assert tuner.choices() == {1: 2}


def test_disabled_with_one_thread_or_when_asked(clock: FakeClock) -> None:
    for tuner in (ThreadTuner(1), ThreadTuner(2, enabled=False)):
        torch.set_num_threads(1)
        for _ in range(2 * TUNING):
            tuner.begin(1)
            tuner.end()
        assert tuner.choices() == {}
        assert torch.get_num_threads() == 1


def test_default_cpu_threads_follows_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_module.default_cpu_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")
    assert threads_module.default_cpu_threads() == len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_module.default_cpu_threads() == len(os.sched_getaffinity(0))


# Run in a fresh interpreter: this test process runs with OMP_NUM_THREADS=1 (tests/conftest.py),
# where no thread ever starts a pool. Prints the threads gained by a plain executor thread and by
# single_threaded_executor's, each running what loading and building the engine run off the loop
# (an elementwise op, a oneDNN weight reorder and packed linear, an MKL matmul) after another
# thread (the engine's) set two threads.
_POOL_PROBE = """
import os, threading, time, torch
from concurrent.futures import ThreadPoolExecutor
from nanoserve.engine.threads import single_threaded_elsewhere, single_threaded_executor
single_threaded_elsewhere()
weight = torch.randn(1536, 384)
def work():
    torch.randn(1024, 1024).add_(1)  # a torch parallel op first: torch sets the count lazily
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    torch.ops.mkldnn._linear_pointwise(torch.randn(64, 384), packed, None, "none", [], "")
    torch.randn(256, 384) @ weight.t()
def settled():  # a joined thread (and an earlier executor's pool) can linger in /proc briefly
    count = -1
    while count != len(os.listdir("/proc/self/task")):
        count = len(os.listdir("/proc/self/task"))
        time.sleep(0.2)
def gained(executor):
    with executor:
        executor.submit(lambda: None).result()
        engine = threading.Thread(target=torch.set_num_threads, args=(2,))
        engine.start(); engine.join()
        settled()
        before = len(os.listdir("/proc/self/task"))
        executor.submit(work).result()
        return len(os.listdir("/proc/self/task")) - before
print(gained(ThreadPoolExecutor(1)), gained(single_threaded_executor()))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: OpenMP never starts a pool")
def test_single_threaded_executor_starts_no_openmp_pool() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", _POOL_PROBE], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    plain, single = int(out[0]), int(out[1])
    assert plain > 0  # the control: without it the check below could not fail
    assert single == 0


def test_a_neighbour_taking_a_core_is_noticed_within_watch_forwards(clock: FakeClock) -> None:
    # Alone, two threads win and are confirmed; then a neighbour takes a core: two threads now take
    # 1.5x as long, one thread (on the other core) is unchanged and the faster. The tuner measures
    # again after WATCH forwards, not after its re-measurement period, and moves to one thread.
    alone, beside = {1: 1.0 * MS, 2: 0.7 * MS}, {1: 1.0 * MS, 2: 1.5 * MS}
    tuner = tuned(clock, 4, alone)
    assert tuner.choices() == {4: 2}
    assert {run(tuner, clock, 4, alone) for _ in range(100)} == {2}  # steady: no re-measurement
    # Within one watch window (part of the current window ran alone), far before FIRST_RETUNE.
    noticed = _forwards_until_measuring(tuner, clock, beside)
    assert noticed <= threads_module.WATCH < threads_module.FIRST_RETUNE
    for _ in range(TUNING - 1):
        run(tuner, clock, 4, beside)
    assert tuner.choices() == {4: 1}


def test_noise_within_the_drift_does_not_remeasure(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads_module, "FIRST_RETUNE", 1000)
    tuner = tuned(clock, 1, {1: 1.0 * MS, 2: 0.5 * MS})
    assert tuner.choices() == {1: 2}
    # Forwards 20% slower or faster than at the choice, in turn, and a few much slower outliers.
    for i in range(400):
        cost = 0.5 * MS * (1.2 if i % 2 else 0.8) * (5 if i % 50 == 0 else 1)
        run(tuner, clock, 1, {1: cost, 2: cost})
        assert tuner.choices() == {1: 2}, f"measuring again after forward {i}"
