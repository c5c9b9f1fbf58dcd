"""The vector units' measured arithmetic peak (bench/peak.c), one of the benchmark's compute limits.

A matrix product cannot beat the rate at which the CPU's vector units multiply and add; torch's
matmul, the limit's other measure, can fall well short of it (MKL's float32 matmul on AMD's Zen 5
ran at about half). So the benchmark takes the larger of the two as the limit. Compiled with the
system's C compiler into a temporary directory once per process; None where there is no compiler
or the CPU lacks the instructions.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("peak.c")
_KINDS = {"avx2 fma": 0, "avx512 fma": 1, "avx512 bf16 dot": 2}


@cache
def _library() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = Path(tempfile.mkdtemp(prefix="nanoserve-peak-")) / "peak.so"
    build = [cc, "-O3", "-std=gnu11", "-shared", "-fPIC", str(_SOURCE), "-o", str(out), "-lpthread"]
    if subprocess.run(build, capture_output=True).returncode != 0:
        return None
    lib = ctypes.CDLL(str(out))
    lib.peak_flops.restype = ctypes.c_double
    lib.peak_flops.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return lib


def _kind_flops(lib: ctypes.CDLL, kind: int, threads: int, rounds: int) -> float:
    """Best of `rounds` runs of ~0.15 s each (the iteration count sized by a first short run)."""
    t0 = time.perf_counter()
    if lib.peak_flops(kind, threads, 100_000) <= 0:
        return 0.0
    iters = max(100_000, int(100_000 * 0.15 / (time.perf_counter() - t0)))
    return max(lib.peak_flops(kind, threads, iters) for _ in range(rounds))


def vector_peaks(dtype: torch.dtype, threads: int, rounds: int = 3) -> dict[str, float]:
    """FLOP/s of each multiply-add kind this CPU has that computes `dtype` (bf16: its dot product
    and, widening, float32's FMAs), on `threads` threads. Empty without a compiler."""
    lib = _library()
    if lib is None:
        return {}
    kinds = ["avx2 fma", "avx512 fma"] + (["avx512 bf16 dot"] if dtype == torch.bfloat16 else [])
    rates = {name: _kind_flops(lib, _KINDS[name], threads, rounds) for name in kinds}
    return {name: rate for name, rate in rates.items() if rate > 0}
