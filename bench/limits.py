"""The machine's limits for a model: memory read bandwidth and matmul throughput, measured, and
what one decode step of a model costs in bytes read and FLOPs."""

from __future__ import annotations

import time

import torch

from bench.peak import vector_peaks
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT


def read_bandwidth(nbytes: int, reads: int) -> float:
    """Bytes per second summing a float32 buffer of `nbytes`, best of `reads` passes."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    best = 0.0
    for _ in range(reads):
        t0 = time.perf_counter()
        buf.sum()
        best = max(best, buf.nbytes / (time.perf_counter() - t0))
    return best


def measure_limits(dtype: torch.dtype, weight_bytes: float = 0.0) -> dict[str, float]:
    """Memory read bandwidth and matmul FLOP/s, best of a few.

    The bandwidth is the better of two reads: a 512 MiB buffer (memory), and a buffer the size of
    the model's weights read over and over (where they fit in the last-level cache, as the 10.7M
    model's 21 MB of bf16 weights do in a 32 MiB L3, and its 43 MB of float32 ones in part, they
    are read from there); with the memory read alone, the engine's batch-1 step of the 10.7M model
    reads its weights faster than the bound."""
    memory = read_bandwidth(512 * 2**20, 5)
    resident = read_bandwidth(int(weight_bytes), 20) if weight_bytes else 0.0
    rates = {str(d).removeprefix("torch."): _matmul_flops(d) for d in dict.fromkeys([dtype, torch.float32])}
    # The vector units' own peak: no matmul beats it, and torch's can fall far short of it (MKL's
    # float32 matmul on AMD Zen 5: ~216 GFLOP/s of a measured ~2x that), which made the old limit
    # read over 100%.
    peaks = {name.replace(" ", "_"): r for name, r in vector_peaks(dtype, torch.get_num_threads()).items()}
    # A CPU without bf16 arithmetic (AVX2) still multiplies bf16 weights at its float32 rate by
    # widening them as they load (the native step does; torch's emulated bf16 matmul is ~100x
    # slower), so the compute limit for a dtype is the fastest of its own rates and float32's.
    return {"bandwidth_GBps": max(memory, resident) / 1e9, "bandwidth_memory_GBps": memory / 1e9,
            "bandwidth_weights_GBps": resident / 1e9,
            "matmul_GFLOPs": max(*rates.values(), *peaks.values()) / 1e9,
            **{f"matmul_GFLOPs_{name}": r / 1e9 for name, r in rates.items()},
            **{f"matmul_GFLOPs_peak_{name}": r / 1e9 for name, r in peaks.items()}}


def _matmul_flops(dtype: torch.dtype) -> float:
    n = 2048 if dtype == torch.float32 else 512  # emulated bf16 takes ~1 s per 2048^3 product
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    best_flops = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best_flops = max(best_flops, 2 * n**3 / (time.perf_counter() - t0))
    return best_flops


def model_costs(cfg: GPTConfig, dtype: torch.dtype) -> tuple[float, float, float]:
    """(bytes of weights read per decode step, matmul FLOPs per generated token, the output
    layer's share of them)."""
    with torch.device("meta"):
        m = GPT(cfg)
    total = sum(p.numel() for p in m.parameters())  # tied lm_head counted once
    elem = torch.finfo(dtype).bits // 8
    # Per token: every Linear (incl. the tied lm_head) costs 2 FLOPs per weight; embeddings are lookups.
    linear = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    return float(total * elem), float(2 * linear), float(2 * m.lm_head.weight.numel())
