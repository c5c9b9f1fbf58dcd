"""Is a reduced-precision dtype fast on this CPU, or emulated?

bfloat16 halves the bytes a decode step reads, but only CPUs with native bf16 matmul support
(AVX-512 BF16, AMX) run it fast: with AVX-512 BF16 a 2048x2048 bf16 matmul runs at ~410 GFLOP/s
(fp32 ~150); on an AVX2-only CPU a 512x512 one runs at 1.3 GFLOP/s against 135 for float32, a
hundred times slower. Asking for bf16 there silently makes the server unusable, so the
engine measures the ratio once at start-up (a few milliseconds) and warns.
"""

from __future__ import annotations

import time

import torch

SIZE = 256
SLOW_FACTOR = 2.0  # warn when the dtype's matmul is this many times slower than float32's


def _best_matmul_s(dtype: torch.dtype, repeats: int = 3) -> float:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(SIZE, SIZE, generator=gen).to(dtype)
    b = torch.randn(SIZE, SIZE, generator=gen).to(dtype)
    a @ b  # first call: kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def cpu_matmul_slowdown(dtype: torch.dtype) -> float:
    """How many times slower a square matmul is in `dtype` than in float32, on this CPU."""
    if dtype == torch.float32:
        return 1.0
    return _best_matmul_s(dtype) / _best_matmul_s(torch.float32)
