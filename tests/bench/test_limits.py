"""bench/limits.py: the read bound for weights that stay in cache."""

from __future__ import annotations

import pytest
import torch

from bench import limits as bench_limits


@pytest.fixture
def fixed_rates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Reads of a 512 MiB buffer at 30 GB/s and of smaller ones at 150 (as from L3); matmuls at
    a fixed rate. Returns the sizes read."""
    sizes: list[int] = []

    def read(nbytes: int, reads: int) -> float:
        sizes.append(nbytes)
        return 30e9 if nbytes >= 512 * 2**20 else 150e9

    monkeypatch.setattr(bench_limits, "read_bandwidth", read)
    monkeypatch.setattr(bench_limits, "_matmul_flops", lambda dtype: 100e9)
    monkeypatch.setattr(bench_limits, "vector_peaks", lambda dtype, threads: {"peak": 200e9})
    return sizes


def test_weights_that_fit_in_cache_are_bounded_by_reading_them_there(fixed_rates: list[int]) -> None:
    # 21 MB of weights: read from the last-level cache at 150 GB/s, not from memory at 30.
    limits = bench_limits.measure_limits(torch.bfloat16, 21e6)
    assert fixed_rates == [512 * 2**20, 21_000_000]
    assert limits["bandwidth_GBps"] == 150 and limits["bandwidth_memory_GBps"] == 30
    assert limits["bandwidth_weights_GBps"] == 150 and limits["matmul_GFLOPs"] == 200


def test_without_the_weights_size_only_memory_is_read(fixed_rates: list[int]) -> None:
    limits = bench_limits.measure_limits(torch.float32)
    assert fixed_rates == [512 * 2**20] and limits["bandwidth_GBps"] == 30
