"""CPU threads: which thread of the process may use several, and how many each forward uses.

Only the engine thread runs multi-threaded torch work. libgomp (torch's OpenMP) keeps a pool of
worker threads for every thread that ever ran a parallel region, and once the process holds more
OpenMP threads than CPUs, every pool's workers stop spinning and sleep after about a thousand
spins, so each parallel region pays futex wake-ups. Measured on the 2-core machine: a 200k-element
add took 18 us in the engine thread alone and 80-126 us once the main thread (or an executor
thread) had run one parallel op; a whole decode forward doubled (10 -> 20 ms, 10.7M bf16 batch
32). So process entry points call `single_threaded_elsewhere()` before touching torch, blocking
work off the event loop runs on `single_threaded_executor()`, and the engine thread sets its own
count (`default_cpu_threads()` unless configured: the CPUs the affinity mask and the cgroup's CPU
quota leave the process, see cpu_quota.py).

Within the engine thread the best count per forward still depends on things no formula knows:
the model's bytes against the caches, the dtype's kernels, and what else the machine does (the
event loop that streams tokens shares the same two cores). So the tuner treats it as an
experiment per forward size (tokens in the forward, rounded to a power of two): the first
forwards of each size take turns between all threads and one, the faster median wins, and the
choice is measured again now and then because the machine's load changes, and at once when the
chosen count's forwards drift from what they took when it was chosen (a neighbour took a core, or
left). Forwards of
ALL_THREADS_FROM tokens or more are compute-bound and always use every thread; so does a size
whose first forwards on every thread take SURE_ALL_THREADS_S or more (long enough that one thread
cannot win), without a turn on one.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from nanoserve.engine.cpu_quota import cpu_budget

# Candidates take turns in blocks of BLOCK forwards; the first forward of a block is not timed:
# it pays for the switch (waking or parking the OpenMP workers) and measured 1.2-1.9x a settled
# forward, which made a close call come out either way from run to run.
BLOCK = 3
ROUNDS = 3  # blocks per candidate before choosing
SAMPLES = ROUNDS * (BLOCK - 1)  # timed forwards per candidate
# Forwards of one size between re-measurements: FIRST_RETUNE after a new or changed choice,
# doubling each time a re-measurement confirms it, up to RETUNE_AFTER. A choice made during a
# transient (measured through HTTP: the first load's burst of connections made two threads slower
# in all six samples of one run, which then decoded on one thread at 1933 instead of ~2600 tok/s)
# is corrected within seconds, and a settled one costs a measurement only every 4000 forwards.
FIRST_RETUNE = 250
RETUNE_AFTER = 4000
ALL_THREADS_FROM = 128  # forward sizes (tokens) that always use every thread
# Measuring starts on every thread, and a size whose first two timed forwards both take this long keeps them
# without a turn on one: with two threads a forward costs half its one-thread time plus what running
# in parallel costs (its barriers, waking the worker), so one thread could only win if that cost
# were over a millisecond a forward. Turns on one thread are not free: the benchmark's 16-token
# prompts at 124M bf16 take 22 ms on one thread instead of 12, 8% of a batch-1 run, and a server
# would pay that for each new size and again at every re-measurement.
SURE_ALL_THREADS_S = 0.002
# The chosen count's forwards are watched: when the median of the last WATCH of them differs from
# the chosen count's median when it was chosen by more than DRIFT either way, the size is measured
# again at once. Beside a process spinning on one of 2 cores, a server that had chosen 2 threads
# alone kept them for its re-measurement period (up to RETUNE_AFTER forwards) at 1.28x the time of
# 1 thread (bench/neighbour.py); the periodic re-measurement alone came minutes late.
WATCH = 24
DRIFT = 1.3


def default_cpu_threads() -> int:
    """Threads for the engine: OMP_NUM_THREADS when set, else the CPUs this process may use (its
    affinity mask and cgroup CPU quota, see cpu_quota.py)."""
    return cpu_budget().threads


def single_threaded_elsewhere() -> None:
    """Put the calling thread on one torch thread (no OpenMP pool), and with it every thread that
    first runs torch before the engine thread sets its own count (torch copies the last count
    set into a thread at its first parallel op). Call before the process's first torch op."""
    # torch sets a thread's count lazily, at its first parallel op or count query, to the count
    # last set anywhere in the process: query first, so the engine thread's later counts cannot
    # overwrite this thread's one.
    torch.get_num_threads()
    torch.set_num_threads(1)


def single_threaded_executor(workers: int | None = None, name: str = "nanoserve-worker"
                             ) -> ThreadPoolExecutor:
    """A thread pool whose threads never start an OpenMP pool of their own.

    torch hands its last set count only to its own parallel ops; oneDNN and MKL size their
    parallel regions from the thread's OpenMP setting, which a new thread takes from the process
    default (every CPU). So `nanoserve serve`, which loads the checkpoint and builds the engine
    (oneDNN weight reorders) in the event loop's default executor, started a second pool there,
    and every parallel region of the engine thread then paid futex wake-ups (its OpenMP worker
    slept ~3,300 times a second under load instead of spinning). Each thread of this pool sets
    its own count to one before it runs anything. `workers`: ThreadPoolExecutor's default when None."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=single_threaded_elsewhere)


@dataclass
class _SizeState:
    samples: dict[int, list[float]]
    choice: int | None = None
    since_choice: int = 0
    turn: int = 0  # forwards run while measuring
    retune_after: int = field(default_factory=lambda: FIRST_RETUNE)  # read when created
    previous: int | None = None  # the choice before this measurement
    chosen_s: float = 0.0  # the choice's median forward when it was chosen (0: not watched)
    recent: list[float] = field(default_factory=list)  # the choice's last forwards since, at most WATCH


class ThreadTuner:
    """Picks torch's intra-op thread count per forward size; CPU only."""

    def __init__(self, max_threads: int, enabled: bool = True) -> None:
        self.max_threads = max_threads
        self.candidates = sorted({1, max_threads}, reverse=True)  # every thread's turn first
        self.enabled = enabled and len(self.candidates) > 1
        self._sizes: dict[int, _SizeState] = {}
        self._pending: tuple[int, int, float] | None = None  # (size, threads, start) of a timed forward

    @staticmethod
    def size_of(tokens: int) -> int:
        return 1 << max(0, tokens - 1).bit_length()

    def begin(self, tokens: int) -> None:
        """Set the thread count for a forward of `tokens` tokens and start its clock."""
        if not self.enabled:
            return
        size = self.size_of(tokens)
        state = self._sizes.get(size)
        if state is None:
            state = self._sizes[size] = _SizeState({c: [] for c in self.candidates})
        if state.choice is not None and state.since_choice >= state.retune_after:
            state.previous = state.choice
            state.choice, state.since_choice, state.turn = None, 0, 0
            for samples in state.samples.values():
                samples.clear()
        timed = False
        if size >= ALL_THREADS_FROM:
            # Large forwards are compute-bound: all threads, no experiment (measuring one thread
            # on a burst's prefill cost 1.09 s instead of 0.63 s at 124M, 1024 tokens).
            threads = self.max_threads
            state.choice = threads
        elif state.choice is not None:
            threads = state.choice
            state.since_choice += 1
            timed = state.chosen_s > 0  # watched for drift (end)
        else:
            block, within = divmod(state.turn, BLOCK)
            threads = self.candidates[block % len(self.candidates)]
            timed = within > 0
            state.turn += 1
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self._pending = (size, threads, time.perf_counter()) if timed else None

    def end(self) -> None:
        """Stop the clock of the forward begun last (not called when it raised)."""
        if self._pending is None:
            return
        size, threads, start = self._pending
        self._pending = None
        state = self._sizes[size]
        if state.choice is not None:
            self._watch(state, time.perf_counter() - start)
            return
        samples = state.samples[threads]
        samples.append(time.perf_counter() - start)
        # The first two timings on every thread: both long, so that one slow outlier (which only
        # ever makes a forward look slower) cannot skip the turns on one thread.
        first_timings = threads == self.max_threads and len(samples) == BLOCK - 1
        if first_timings and min(samples) >= SURE_ALL_THREADS_S:
            self._choose(state, self.max_threads)
        elif all(len(s) >= SAMPLES for s in state.samples.values()):
            self._choose(state, min(self.candidates, key=lambda c: statistics.median(state.samples[c])))

    @staticmethod
    def _choose(state: _SizeState, threads: int) -> None:
        state.choice = threads
        confirmed = threads == state.previous
        state.retune_after = min(2 * state.retune_after, RETUNE_AFTER) if confirmed else FIRST_RETUNE
        state.chosen_s, state.recent = statistics.median(state.samples[threads]), []

    @staticmethod
    def _watch(state: _SizeState, took: float) -> None:
        """A forward on the chosen count: past DRIFT from the choice's time, measure again now."""
        state.recent.append(took)
        if len(state.recent) < WATCH:
            return
        now = statistics.median(state.recent)
        state.recent = []
        if not state.chosen_s / DRIFT <= now <= state.chosen_s * DRIFT:
            state.since_choice = state.retune_after  # the next forward of this size measures

    def choices(self) -> dict[int, int]:
        """Forward size -> chosen thread count, for sizes measured so far."""
        return {size: s.choice for size, s in sorted(self._sizes.items()) if s.choice is not None}
